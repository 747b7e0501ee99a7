"""Per-request planning time, per decode rank, with the Planner (its templates) reused across requests.

Not a test: run `python benchmarks/plan_speed.py [--repeats N] [--tokens N] [--vary-tokens]`. Targets:
under 0.5 ms per decode rank per request for qwen3.5-397b-a17b, 8192 tokens, P2 -> D8 and P8 -> D2
(issue 3), and for a warm 131,072-token pack plan whose token counts vary (issue 20: the pack recipe
is keyed on the segment structure). Each timed call plans a fresh request (its own block ids),
validation included. Auto rows plan with the default (H200) cost model: their descriptor count
shows the mode it chose (one or two per source: pack).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from hybrid_transfer.layout import load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PlanMode

_NUM_REQUESTS = 16  # distinct block-id sets cycled through, so no run times one cached request
_LONG = 131_072  # the long-context pack row


def measure(preset: str, p: int, d: int, num_tokens: int, fragmentation: float, mode: PlanMode, repeats: int,
            validate: bool, seed: int = 0, vary_tokens: bool = False) -> tuple[float, float, int]:
    """(median us, p90 us, descriptors) of plan() per decode rank per request, over every decode rank.

    ``vary_tokens``: every timed request has a token count of its own (num_tokens - 7 i), as prompts do
    in serving, so no per-shape cache (Recipe, PackRecipe) is ever hit.
    """
    model = load_preset(preset)
    probe_p = fake_engine(model, p, None, 1)[0]
    probe_d = fake_engine(model, d, None, 1)[0]
    counts_p = blocks_needed(model, probe_p.block_size, num_tokens)
    counts_d = blocks_needed(model, probe_d.block_size, num_tokens)
    pool_p, pool_d = 8 * sum(counts_p), 8 * sum(counts_d)
    producers = fake_engine(model, p, None, pool_p, 0)
    consumers = fake_engine(model, d, None, pool_d, 1)
    rng = np.random.default_rng(seed)
    requests = [(make_block_ids(counts_d, pool_d, fragmentation, rng), make_block_ids(counts_p, pool_p, fragmentation,
                                                                                      rng))
                for _ in range(_NUM_REQUESTS)]
    samples: list[float] = []
    descriptors = 0
    for rank in range(d):
        planner = Planner(model, consumers[rank], producers)
        for _ in range(2):  # warm the shape's caches (pack builds its recipe at a shape's second request)
            planner.plan(*requests[0], num_tokens, mode, validate=validate)
        for i in range(repeats):
            local, remote = requests[i % _NUM_REQUESTS]
            tokens = num_tokens
            if vary_tokens:  # fewer tokens than the ids cover: the planner reads the leading blocks of each list
                tokens = max(1, num_tokens - 7 * (i + 1) % num_tokens)
                local, remote = _trim(model, probe_d, local, tokens), _trim(model, probe_p, remote, tokens)
            t0 = time.perf_counter()
            plan = planner.plan(local, remote, tokens, mode, validate=validate)
            samples.append(time.perf_counter() - t0)
        descriptors = max(descriptors, plan.num_descriptors)
    us = np.array(samples) * 1e6
    return float(np.median(us)), float(np.percentile(us, 90)), descriptors


def _trim(model, probe, ids, tokens: int):
    """Each group's first blocks_needed(tokens) ids (the ticket of a shorter request on the same blocks)."""
    return [list(group[:n]) for group, n in zip(ids, blocks_needed(model, probe.block_size, tokens), strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-397b-a17b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=300, help="timed requests per decode rank")
    parser.add_argument("--no-validate", action="store_true", help="time planning without validation")
    parser.add_argument("--vary-tokens", action="store_true",
                        help="give every timed request a token count of its own (serving's case: no per-shape cache hit)")
    args = parser.parse_args()
    print(f"{args.preset}, {args.tokens} tokens{' (each request its own count below it)' if args.vary_tokens else ''}, "
          f"validate={not args.no_validate}, "
          f"{args.repeats} requests per decode rank")
    header = f"{'topology':>9} {'blocks':>11} {'mode':>10} {'descriptors':>11} {'median us':>10} {'p90 us':>8}"
    print(header)
    print("-" * len(header))
    for p, d in ((2, 8), (8, 2)):
        for fragmentation, label in ((0.0, "contiguous"), (1.0, "fragmented")):
            for mode in (PlanMode.NAIVE, PlanMode.COALESCED):
                med, p90, desc = measure(args.preset, p, d, args.tokens, fragmentation, mode, args.repeats,
                                         not args.no_validate, vary_tokens=args.vary_tokens)
                print(f"{f'P{p}->D{d}':>9} {label:>11} {mode.value:>10} {desc:>11} {med:>10.1f} {p90:>8.1f}")
    # Pack: the path the engine runs for many small rows (docs/planner.md#pack); descriptors = read ranges.
    long_pack = []
    for p, d, tokens in ((2, 8, args.tokens), (1, 1, args.tokens), (2, 8, _LONG), (1, 1, _LONG)):
        for fragmentation, label in ((0.0, "contiguous"), (1.0, "fragmented")):
            for mode in (PlanMode.PACK, PlanMode.AUTO):
                med, p90, desc = measure(args.preset, p, d, tokens, fragmentation, mode, args.repeats,
                                         not args.no_validate, vary_tokens=args.vary_tokens)
                print(f"{f'P{p}->D{d}':>9} {label:>11} {mode.value:>10} {desc:>11} {med:>10.1f} {p90:>8.1f}"
                      f"{'' if tokens == args.tokens else f'  ({tokens} tokens)'}")
                if tokens == _LONG and mode is PlanMode.PACK:
                    long_pack.append(med)
    print(f"warm {_LONG}-token pack plan, median us per decode rank (worst row): {max(long_pack):.1f} "
          f"(target 500; {'counts varying' if args.vary_tokens else 'one count: add --vary-tokens for serving'})")


if __name__ == "__main__":
    main()
