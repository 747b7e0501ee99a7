"""Recipes keyed on the segment structure: token counts with the same last cut share one recipe, patched per count.

A planner that built the recipe for one count must plan every other count of that structure exactly as a
fresh planner does (docs/planner.md#per-request-cost).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hybrid_transfer.layout import CacheOptions, KVLayout, load_preset
from hybrid_transfer.plan.pieces import last_cut
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PlanMode

Q397 = "qwen3.5-397b-a17b"


def assert_same(a, b, where: str = "plan") -> None:
    """Every field of two plans equal, arrays element for element (and dtype), recursing into dataclasses."""
    assert type(a) is type(b), where
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        np.testing.assert_array_equal(a, b, err_msg=where)
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, (tuple, list)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def structure_counts(planner: Planner, near: int) -> tuple[int, list[int]]:
    """The last cut below ``near`` and counts that share it: its first token to the next cut, inclusive."""
    cut = last_cut(near, planner.local, planner.remote)
    nxt = min((cut // kb + 1) * kb for kb in (planner.local.kernel_block_size, planner.remote.kernel_block_size))
    counts = sorted({nxt, nxt - 1, nxt - 7, cut + (nxt - cut) // 2, cut + 2, cut + 1})
    assert all(last_cut(n, planner.local, planner.remote) == cut for n in counts)
    assert last_cut(nxt + 1, planner.local, planner.remote) != cut  # the structure really ends at nxt
    return cut, counts


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("p", "d"), [(1, 1), (2, 8), (8, 2)])
@pytest.mark.parametrize("fragmentation", [0.0, 1.0])
@pytest.mark.parametrize("mode", [PlanMode.COALESCED, PlanMode.NAIVE, PlanMode.PACK])
def test_counts_of_one_structure_share_a_recipe_and_plan_like_a_fresh_planner(layout, p, d, fragmentation, mode):
    model = load_preset(Q397)
    options = CacheOptions(kv_layout=layout)
    producers = fake_engine(model, p, options, 64, 0)
    consumers = fake_engine(model, d, options, 64, 1)
    rank = d - 1
    warm = Planner(model, consumers[rank], producers)
    cut, counts = structure_counts(warm, 5000)
    rng = np.random.default_rng(len(counts) + p * 10 + d)
    local = make_block_ids(blocks_needed(model, consumers[0].block_size, counts[-1]), 64, fragmentation, rng)
    remote = make_block_ids(blocks_needed(model, producers[0].block_size, counts[-1]), 64, fragmentation, rng)
    # The last count builds the recipe; every other count reuses it (twice: pack builds its own recipe
    # from the patched one at a count's second request).
    order = [counts[-1], *counts[:-1]] if mode is not PlanMode.NAIVE else counts[::-1]
    for n in order:
        for _ in range(2):
            got = warm.plan(local, remote, n, mode)
            want = Planner(model, consumers[rank], producers).plan(local, remote, n, mode)
            assert_same(got, want, f"{n} tokens")
            assert got.expected_bytes == want.expected_bytes
    assert len(warm._recipes) == 1, f"counts {counts} after cut {cut} built {len(warm._recipes)} recipes"
