"""The long-context pack plan per decode rank, every request its own token count (issue 26).

Not a test: run `python benchmarks/plan_pack_long.py [--rounds 5] [--repeats 60] [--spread 420]`.
Defaults: qwen3.5-397b-a17b, P2 -> D8, 131,072 tokens, pack mode, fragmentation 1 (every id drawn at
random from a pool 8x the request's blocks), validation on. Each round plans, for every decode rank,
with a fresh Planner warmed by two requests at the nominal count, then ``--repeats`` timed requests
with distinct counts drawn from [tokens - spread, tokens + spread] (a count's own cache never hits;
a count in a segment structure not seen yet pays that structure's first and second requests), each on
its own block ids. Prints per round the median, p90 and mean us of ``Planner.plan`` per decode rank
per request over all ranks, then the min and median of the round medians, and the load average
(the host is shared: figures move with it). ``--evict MIB`` writes over that many MiB before each timed
request, so the planner's arrays are out of the caches as on a decode thread between requests (the READ's
memcpy evicts them; 64 is twice this host's L3). Target: 500 us.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

from hybrid_transfer.layout import load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PlanMode

_NUM_ID_SETS = 16  # distinct block-id sets cycled through, so no timed request repeats another's ids


def one_round(args, rng: np.random.Generator) -> np.ndarray:
    """Microseconds of every timed plan() of one round, all decode ranks."""
    model = load_preset(args.preset)
    probe_p = fake_engine(model, args.prefill_tp, None, 1)[0]
    probe_d = fake_engine(model, args.decode_tp, None, 1)[0]
    top = args.tokens + args.spread
    counts_p = blocks_needed(model, probe_p.block_size, top)
    counts_d = blocks_needed(model, probe_d.block_size, top)
    pool_p, pool_d = 8 * sum(counts_p), 8 * sum(counts_d)
    producers = fake_engine(model, args.prefill_tp, None, pool_p, 0)
    consumers = fake_engine(model, args.decode_tp, None, pool_d, 1)
    id_sets = [(make_block_ids(counts_d, pool_d, args.fragmentation, rng),
                make_block_ids(counts_p, pool_p, args.fragmentation, rng)) for _ in range(_NUM_ID_SETS)]
    mode = PlanMode(args.mode)
    low = max(1, args.tokens - args.spread)
    samples = []
    scratch = np.zeros(args.evict << 17, dtype=np.int64)  # MiB of int64
    for rank in range(args.decode_tp):
        planner = Planner(model, consumers[rank], producers)
        warm = (_trim(model, probe_d, id_sets[0][0], args.tokens), _trim(model, probe_p, id_sets[0][1], args.tokens))
        for _ in range(2):  # the nominal count's structure warm (pack builds a structure's recipe at its second request)
            planner.plan(*warm, args.tokens, mode)
        counts = rng.choice(np.arange(low, top + 1), size=args.repeats, replace=top + 1 - low < args.repeats)
        for i, n in enumerate(counts.tolist()):
            local, remote = id_sets[i % _NUM_ID_SETS]
            local, remote = _trim(model, probe_d, local, n), _trim(model, probe_p, remote, n)
            if scratch.shape[0]:
                scratch += 1
            t0 = time.perf_counter()
            planner.plan(local, remote, n, mode)
            samples.append(time.perf_counter() - t0)
    return np.array(samples) * 1e6


def _trim(model, probe, ids, tokens: int) -> list[list[int]]:
    """Each group's first blocks_needed(tokens) ids (the ticket of a shorter request on the same blocks)."""
    return [list(group[:n]) for group, n in zip(ids, blocks_needed(model, probe.block_size, tokens), strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-397b-a17b")
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=131_072)
    parser.add_argument("--spread", type=int, default=420, help="counts drawn from [tokens - spread, tokens + spread]")
    parser.add_argument("--fragmentation", type=float, default=1.0)
    parser.add_argument("--mode", default=PlanMode.PACK.value, choices=[m.value for m in PlanMode])
    parser.add_argument("--repeats", type=int, default=60, help="timed requests per decode rank per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evict", type=int, default=0, help="MiB written before each timed request (0: warm)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    load0 = os.getloadavg()
    print(f"{args.preset}, P{args.prefill_tp}->D{args.decode_tp}, {args.mode}, fragmentation {args.fragmentation}, "
          f"counts in [{args.tokens - args.spread}, {args.tokens + args.spread}], {args.repeats} requests per decode "
          f"rank per round, {f'{args.evict} MiB evicted before each' if args.evict else 'warm'}; load average {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")
    header = f"{'round':>5} {'median us':>10} {'p90 us':>8} {'mean us':>8} {'max us':>8}"
    print(header)
    print("-" * len(header))
    medians = []
    for r in range(args.rounds):
        us = one_round(args, rng)
        medians.append(float(np.median(us)))
        print(f"{r:>5} {medians[-1]:>10.1f} {np.percentile(us, 90):>8.1f} {us.mean():>8.1f} {us.max():>8.1f}")
    load1 = os.getloadavg()
    print(f"median us per decode rank per request: min {min(medians):.1f}, median {float(np.median(medians)):.1f} "
          f"over {args.rounds} rounds (target 500); load average now {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")


if __name__ == "__main__":
    main()
