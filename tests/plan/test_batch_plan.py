"""A step's batched plan (engine/read_batch.py) equals the concatenation of its requests' own plans.

One warm planner plans every request of a step (recipes shared by shape) and ``batch_plans`` joins the
direct rows per source rank; each request planned alone by a fresh planner must give the same rows in the
same order, row ranges that point at them, and the same staged sources, over modes, layouts and TP pairs.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_recipe_tail import assert_same

from hybrid_transfer.engine.read_batch import batch_plans, plan_batch
from hybrid_transfer.layout import CacheOptions, KVLayout, load_preset
from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PlanMode, SourcePlan

TOPOLOGIES = [("qwen3.5-397b-a17b", 1, 1), ("qwen3.5-397b-a17b", 2, 8), ("qwen3.5-397b-a17b", 8, 2),
              ("qwen3.5-27b", 2, 4), ("qwen3.5-27b", 4, 1), ("qwen3.5-0.8b", 1, 2)]
COSTS = [None, CostModel(per_descriptor_s=1.0)]  # auto: the planner's own model, or one that packs every shape
POOL = 512


def step(topology, layout, requests, seed: int, pool: int):
    """One decode rank of a (preset, P, D) pair and a step's (local ids, remote ids, num_tokens) per
    (num_tokens, fragmentation) of ``requests``; returns (model, the rank's descriptor, producers, items)."""
    preset, p, d = topology
    model = load_preset(preset)
    options = CacheOptions(kv_layout=layout)
    producers = fake_engine(model, p, options, pool, 0)
    consumer = fake_engine(model, d, options, pool, 1)[seed % d]
    rng = np.random.default_rng(seed)
    items = []
    for n, fragmentation in requests:
        local = make_block_ids(blocks_needed(model, consumer.block_size, n), pool, fragmentation, rng)
        remote = make_block_ids(blocks_needed(model, producers[0].block_size, n), pool, fragmentation, rng)
        items.append((local, remote, n))
    return model, consumer, producers, items


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(TOPOLOGIES), layout=st.sampled_from(list(KVLayout)),
       mode=st.sampled_from(list(PlanMode)), cost=st.sampled_from(COSTS),
       requests=st.lists(st.tuples(st.integers(1, 6000), st.sampled_from([0.0, 0.5, 1.0])), min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_the_batched_plan_is_the_concatenation_of_the_per_request_plans(topology, layout, mode, cost, requests,
                                                                         seed):
    model, consumer, producers, items = step(topology, layout, requests, seed, POOL)
    batch = plan_batch(Planner(model, consumer, producers), items, mode, cost)
    alone = [Planner(model, consumer, producers).plan(local, remote, n, mode, cost=cost)
             for local, remote, n in items]
    assert_same(batch.plans, tuple(alone), "plans")
    assert_same(batch_plans(alone), batch, "batch of the requests planned alone")
    ranks = []
    for plan in alone:
        ranks += [s.source_rank for s in plan.sources if isinstance(s, SourcePlan) and s.source_rank not in ranks]
    assert [r.source_rank for r in batch.reads] == ranks
    for read in batch.reads:
        direct = [(i, s) for i, plan in enumerate(alone) for s in plan.sources
                  if isinstance(s, SourcePlan) and s.source_rank == read.source_rank]
        np.testing.assert_array_equal(read.local, np.concatenate([s.local_descs() for _, s in direct]))
        np.testing.assert_array_equal(read.remote, np.concatenate([s.remote_descs() for _, s in direct]))
        assert [i for i, _, _ in read.rows] == [i for i, _ in direct]
        for (_, first, end), (_, s) in zip(read.rows, direct, strict=True):
            np.testing.assert_array_equal(read.local[first:end], s.local_descs())
            np.testing.assert_array_equal(read.remote[first:end], s.remote_descs())
    staged = [(i, s) for i, plan in enumerate(alone) for s in plan.sources if not isinstance(s, SourcePlan)]
    assert_same(batch.staged, tuple(staged), "staged")
    assert batch.num_descriptors == sum(plan.num_descriptors for plan in alone)
