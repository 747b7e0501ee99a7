"""One step's requests planned in one pass (``Planner.plan_many``) against each planned alone (``Planner.plan``).

Not a test: run `python benchmarks/plan_many_speed.py [--preset P] [--tokens N] [--batch 16] [--repeats 50] [--ticket]`.
P1 -> D1, auto mode, fragmented ids, every request of a step its own ids; a warm planner (the shape's
recipe cached) for both; ``--ticket`` passes each item as the engine does (remote ids a ticket's tuple of tuples of
ints, and first_token); prints microseconds per request for each, the best of three passes.
docs/lifecycle.md#batched-reads.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybrid_transfer.layout import CacheOptions, load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PlanMode

POOL = 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-397b-a17b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=16, help="requests per step")
    parser.add_argument("--repeats", type=int, default=50, help="steps timed per pass")
    parser.add_argument("--ticket", action="store_true",
                        help="the engine's form: (local arrays, a ticket's tuple of tuples of ints, n, first_token)")
    args = parser.parse_args()
    model = load_preset(args.preset)
    producers = fake_engine(model, 1, CacheOptions(), POOL, 0)
    consumers = fake_engine(model, 1, CacheOptions(), POOL, 1)
    planner = Planner(model, consumers[0], producers)
    rng = np.random.default_rng(0)
    items = []
    for _ in range(args.batch):
        local = make_block_ids(blocks_needed(model, consumers[0].block_size, args.tokens), POOL, 1.0, rng)
        remote = make_block_ids(blocks_needed(model, producers[0].block_size, args.tokens), POOL, 1.0, rng)
        local_ids = [np.asarray(g, dtype=np.int64) for g in local]
        if args.ticket:
            items.append((local_ids, tuple(tuple(int(b) for b in g) for g in remote), args.tokens, 0))
        else:
            items.append((local_ids, remote, args.tokens))
    alone, batched = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(args.repeats):
            for local, remote, n, *first in items:
                planner.plan(local, remote, n, PlanMode.AUTO, first_token=first[0] if first else 0)
        t1 = time.perf_counter()
        for _ in range(args.repeats):
            planner.plan_many(items, PlanMode.AUTO)
        t2 = time.perf_counter()
        alone.append((t1 - t0) / args.repeats / args.batch)
        batched.append((t2 - t1) / args.repeats / args.batch)
    print(f"{args.preset}, {args.tokens} tokens, P1 -> D1, {args.batch} requests per step: "
          f"plan {1e6 * min(alone):.1f} us / request, plan_many {1e6 * min(batched):.1f} us / request")


if __name__ == "__main__":
    main()
