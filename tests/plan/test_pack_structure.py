"""Pack recipes keyed on the segment structure (plan/pack.py, ``structure_recipe``).

Token counts with one last cut share one pack recipe per source; every plan it gives equals the
unkeyed reference (``to_pack``: the direct rows mapped onto the source's staging, what a fresh
planner gives a shape's first request), over modes, layouts, TP pairs and block sizes
(docs/planner.md#per-request-cost).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_recipe_tail import assert_same

from hybrid_transfer.layout import CacheOptions, KVLayout, load_preset
from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.pack import PackRecipe
from hybrid_transfer.plan.pieces import last_cut
from hybrid_transfer.plan.planner import Planner, to_pack
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode, ReadPlan

# Auto with descriptors this dear packs every source of a multi-descriptor shape.
PACKS = CostModel(per_descriptor_s=1.0)
# (preset, P, D, prefill (block, kernel block), decode (block, kernel block)); None: the preset's own sizes.
TOPOLOGIES = [
    ("qwen3.5-397b-a17b", 1, 1, None, None),
    ("qwen3.5-397b-a17b", 2, 8, None, None),
    ("qwen3.5-397b-a17b", 8, 2, None, None),
    ("qwen3.5-27b", 2, 4, (48 * 64, 16), (40 * 64, 8)),
    ("qwen3.5-27b", 1, 4, (64 * 64, 64), (24 * 64, 8)),
    ("qwen3.5-27b", 4, 1, (32 * 64, 32), (32 * 64, 32)),
]
POOL = 256


def _options(layout: KVLayout, sizes: tuple[int, int] | None) -> CacheOptions:
    if sizes is None:
        return CacheOptions(kv_layout=layout)
    return CacheOptions(block_size=sizes[0], kernel_block_size=sizes[1], kv_layout=layout)


def _reference(planner: Planner, plan: ReadPlan, remote, n: int) -> ReadPlan:
    tpl = {t.source_rank: t for t in planner.templates}
    ids = [np.asarray(g, dtype=np.int64) for g in remote]
    return ReadPlan(plan.decode_rank, plan.mode, tuple(to_pack(s.direct, tpl[s.source_rank], ids, n)
                                                       for s in plan.sources), plan.notify, n, plan.expected_bytes,
                    plan.meta)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(TOPOLOGIES), layout=st.sampled_from(list(KVLayout)),
       mode=st.sampled_from([PlanMode.PACK, PlanMode.AUTO]), near=st.integers(1, 3000),
       fragmentation=st.sampled_from([0.0, 0.5, 1.0]), picks=st.lists(st.integers(0, 10_000), min_size=3, max_size=8),
       seed=st.integers(0, 2**16))
def test_counts_of_one_structure_share_one_pack_recipe_and_plan_like_the_reference(
        topology, layout, mode, near, fragmentation, picks, seed):
    preset, p, d, bs_p, bs_d = topology
    model = load_preset(preset)
    producers = fake_engine(model, p, _options(layout, bs_p), POOL, 0)
    consumers = fake_engine(model, d, _options(layout, bs_d), POOL, 1)
    rank = seed % d
    planner = Planner(model, consumers[rank], producers, cost=PACKS)
    cut = last_cut(near, planner.local, planner.remote)
    end = min((cut // kb + 1) * kb for kb in (planner.local.kernel_block_size, planner.remote.kernel_block_size))
    assert last_cut(end, planner.local, planner.remote) == cut != last_cut(end + 1, planner.local, planner.remote)
    counts = [cut + 1 + k % (end - cut) for k in picks] + [end, cut + 1]  # the edges too, in a drawn order
    rng = np.random.default_rng(seed)
    local = make_block_ids(blocks_needed(model, consumers[0].block_size, end), POOL, fragmentation, rng)
    remote = make_block_ids(blocks_needed(model, producers[0].block_size, end), POOL, fragmentation, rng)
    for n in counts + counts[::-1]:
        got = planner.plan(local, remote, n, mode)
        assert all(isinstance(s, PackSourcePlan) for s in got.sources), got.meta
        assert_same(got, _reference(planner, got, remote, n), f"{n} tokens after cut {cut}")
    # One recipe per source for the whole structure, none keyed on an exact count.
    assert set(planner._packs) == {(cut, tuple(map(len, local)), tuple(map(len, remote)), i)
                                   for i in range(len(planner.templates))
                                   if any(s.source_rank == planner.templates[i].source_rank for s in got.sources)}
    assert all(isinstance(r, PackRecipe) for r in planner._packs.values())


@pytest.mark.parametrize(("p", "d"), [(2, 8), (1, 1)])
def test_a_long_request_of_every_count_near_131072_tokens_reuses_one_recipe(p, d):
    """The long-context row: counts of one structure at 131,072 tokens are planned from one recipe, each
    equal to the reference (benchmarks/plan_speed.py times this path)."""
    model = load_preset("qwen3.5-397b-a17b")
    producers, consumers = fake_engine(model, p, None, 512, 0), fake_engine(model, d, None, 512, 1)
    planner = Planner(model, consumers[0], producers)
    cut = last_cut(131_072, planner.local, planner.remote)
    rng = np.random.default_rng(7)
    local = make_block_ids(blocks_needed(model, consumers[0].block_size, 131_072), 512, 1.0, rng)
    remote = make_block_ids(blocks_needed(model, producers[0].block_size, 131_072), 512, 1.0, rng)
    for n in (131_072, 131_072 - 7, cut + 1, 131_072 - 100):
        got = planner.plan(local, remote, n, PlanMode.PACK)
        assert_same(got, _reference(planner, got, remote, n), f"{n} tokens")
    (key,) = planner._packs
    assert key[0] == cut and planner._packs[key].slope is not None
