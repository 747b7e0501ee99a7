"""Descriptor merges across cache groups under vLLM-pool allocation (issue 20, Deliver 2): worth building?

Not a test: run `python benchmarks/cross_group_merges.py [--tokens N] [--requests R] [--seeds K]`.

Block ids come from bench/vllm_pool.py (vLLM 0.33's shared block pool after a churn, prefill and decode
simulated independently, the bench's pool and live requests), beside the bench's fragmentation 0 and 1.
Each request is planned by today's planner in coalesced mode on every decode rank (fake addresses, one
region per shared tensor). Then, per READ (decode rank, source), rows sorted by local address:

- ``xg now``: merges across groups that need no padding moved (an attention run ending where a state slot
  starts on both sides). Coalesced merges by address, not by group, so today's planner already makes
  them: counted as the group changes inside today's rows.
- ``+pad``: merges possible if page padding may move: two neighbouring rows whose gaps are equal on both
  sides, lie wholly in this request's own pages there, and hold no byte this decode rank reads (so only
  padding: a state page's tail, the unused tokens of a last attention block). ``+pad xg`` counts the ones
  across groups, the cross-group merging issue 20 asks about; ``+pad in`` the rest (within one group).
- ``moved``: bytes moved with every padding merge, over the valid bytes.

Prints descriptors per request summed over decode ranks (what the bench reports) and the share a
cross-group merge with moved padding would remove. Decision rule (issue 20): build it only if >= 20%.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import numpy as np

from hybrid_transfer.bench import sizing
from hybrid_transfer.bench.spec import BenchSpec
from hybrid_transfer.layout import load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor
from hybrid_transfer.plan.scenario import fake_engine
from hybrid_transfer.plan.types import PlanMode

CASES = (("qwen3.5-0.8b", 1, 1), ("qwen3.5-0.8b", 1, 2), ("qwen3.5-0.8b", 2, 1),
         ("qwen3.5-397b-a17b", 1, 1), ("qwen3.5-397b-a17b", 2, 8), ("qwen3.5-397b-a17b", 8, 2),
         ("qwen3.5-397b-a17b", 4, 4))
ALLOCATIONS = (("frag 0", "fragmentation", 0.0), ("frag 1", "fragmentation", 1.0), ("vllm-pool", "vllm-pool", 0.0))


@dataclass
class Counts:
    descriptors: int = 0
    xg_now: int = 0
    pad_xg: int = 0
    pad_in: int = 0
    valid_bytes: int = 0
    pad_bytes: int = 0

    def add(self, other: Counts) -> None:
        for k in vars(self):
            setattr(self, k, getattr(self, k) + getattr(other, k))


class PageMap:
    """Which of a request's groups owns each page of one side (-1: not this request's)."""

    def __init__(self, block_ids, num_blocks: int):
        self.group = np.full(num_blocks, -1, dtype=np.int64)
        for g, ids in enumerate(block_ids):
            self.group[np.asarray(ids, dtype=np.int64)] = g
        self.owned_csum = np.concatenate(([0], np.cumsum(self.group >= 0)))

    def pages(self, desc: RankDescriptor, addr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tensor, page) of each address."""
        bases = np.asarray(desc.tensor_addrs, dtype=np.int64)
        order = np.argsort(bases)
        t = order[np.searchsorted(bases[order], addr, side="right") - 1]
        return t, (addr - bases[t]) // desc.page_bytes

    def all_owned(self, desc: RankDescriptor, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Whether every byte of [a, b) lies in this request's pages of one tensor."""
        ta, pa = self.pages(desc, a)
        tb, pb = self.pages(desc, b - 1)
        inside = (ta == tb) & (pa >= 0) & (pb < self.group.shape[0])
        pa, pb = np.clip(pa, 0, self.group.shape[0] - 1), np.clip(pb, 0, self.group.shape[0] - 1)
        return inside & (self.owned_csum[pb + 1] - self.owned_csum[pa] == pb - pa + 1)


def _uncovered(starts: np.ndarray, ends: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Whether [a, b) meets none of the sorted, disjoint rows [starts, ends)."""
    i = np.searchsorted(starts, b, side="left") - 1
    return (i < 0) | (ends[np.maximum(i, 0)] <= a)


def count_request(planners, consumers, producers, local_ids, remote_ids, tokens) -> Counts:
    out = Counts()
    local_map = PageMap(local_ids, consumers[0].num_blocks)
    remote_map = PageMap(remote_ids, producers[0].num_blocks)
    for d, planner in enumerate(planners):
        plan = planner.plan(local_ids, remote_ids, tokens, PlanMode.COALESCED)
        out.descriptors += plan.num_descriptors
        out.valid_bytes += plan.total_bytes
        all_l = np.concatenate([s.local_addr for s in plan.sources])
        all_e = all_l + np.concatenate([s.length for s in plan.sources])
        order = np.argsort(all_l)
        cov_s, cov_e = all_l[order], all_e[order]
        for src in plan.sources:
            o = np.argsort(src.local_addr)
            loc, rem, ln = src.local_addr[o], src.remote_addr[o], src.length[o]
            # group changes inside today's rows: page by page from each row's first to its last page
            t0, p0 = local_map.pages(consumers[d], loc)
            _, p1 = local_map.pages(consumers[d], loc + ln - 1)
            for a, b in zip(p0.tolist(), p1.tolist(), strict=True):
                if b > a:
                    g = local_map.group[a:b + 1]
                    out.xg_now += int(np.count_nonzero(g[1:] != g[:-1]))
            if loc.shape[0] < 2:
                continue
            end_l, end_r = loc[:-1] + ln[:-1], rem[:-1] + ln[:-1]
            gap_l, gap_r = loc[1:] - end_l, rem[1:] - end_r
            cand = (gap_l == gap_r) & (gap_l > 0)
            ok = np.zeros_like(cand)
            idx = cand.nonzero()[0]
            if idx.size:
                a_l, b_l = end_l[idx], loc[1:][idx]
                a_r, b_r = end_r[idx], rem[1:][idx]
                ok[idx] = (_uncovered(cov_s, cov_e, a_l, b_l) & local_map.all_owned(consumers[d], a_l, b_l)
                           & remote_map.all_owned(producers[src.source_rank], a_r, b_r))
            _, last_page = local_map.pages(consumers[d], end_l - 1)
            _, next_page = local_map.pages(consumers[d], loc[1:])
            cross = local_map.group[last_page] != local_map.group[next_page]
            out.pad_xg += int(np.count_nonzero(ok & cross))
            out.pad_in += int(np.count_nonzero(ok & ~cross))
            out.pad_bytes += int(gap_l[ok].sum())
    return out


def run_case(preset: str, p: int, d: int, tokens: int, requests: int, allocation: str, fragmentation: float,
             seeds: int) -> Counts:
    total = Counts()
    model = load_preset(preset)
    for seed in range(seeds):
        spec = BenchSpec(preset=preset, prefill_tp=p, decode_tp=d, tokens=tokens, requests=requests,
                         allocation=allocation, fragmentation=fragmentation, seed=seed).validate()
        prod, cons = sizing.layouts(spec, spec.points[0], 0)
        producers = fake_engine(model, p, None, sizing.pool_blocks(spec, True), engine_index=0)
        consumers = fake_engine(model, d, None, sizing.pool_blocks(spec, False), engine_index=1)
        planners = [Planner(model, consumers[r], producers) for r in range(d)]
        for lp, lc in zip(prod, cons, strict=True):
            total.add(count_request(planners, consumers, producers, lc.block_ids, lp.block_ids, tokens))
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=16, help="timed requests per pool (the bench's --requests)")
    ap.add_argument("--seeds", type=int, default=2, help="independent churns per case")
    args = ap.parse_args()
    n = args.requests * args.seeds
    print(f"{args.tokens} tokens, {args.requests} requests per pool ({2 * args.requests} live), {args.seeds} seeds; "
          "descriptors per request summed over decode ranks")
    print(f"{'preset':<18} {'P->D':<6} {'allocation':<10} {'desc':>8} {'xg now':>7} {'+pad xg':>8} {'+pad in':>8} "
          f"{'after xg':>9} {'-xg %':>6} {'after all':>9} {'-all %':>6} {'moved/valid':>11}")
    for preset, p, d in CASES:
        for label, allocation, frag in ALLOCATIONS:
            c = run_case(preset, p, d, args.tokens, args.requests, allocation, frag, args.seeds)
            desc = c.descriptors / n
            after_xg = (c.descriptors - c.pad_xg) / n
            after_all = (c.descriptors - c.pad_xg - c.pad_in) / n
            print(f"{preset:<18} {f'{p}->{d}':<6} {label:<10} {desc:>8.1f} {c.xg_now / n:>7.1f} {c.pad_xg / n:>8.1f} "
                  f"{c.pad_in / n:>8.1f} {after_xg:>9.1f} {100 * (1 - after_xg / desc):>5.1f}% {after_all:>9.1f} "
                  f"{100 * (1 - after_all / desc):>5.1f}% {(c.valid_bytes + c.pad_bytes) / c.valid_bytes:>11.4f}")


if __name__ == "__main__":
    main()
