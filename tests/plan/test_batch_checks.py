"""``Planner.plan_many`` (one pass of checks over a step, plan/batch_checks.py) against ``Planner.plan`` alone.

For every request of a step, plan_many gives exactly what plan gives for it on a fresh planner: the same
plan, or a PlanError of the same class naming the same values. Some requests are corrupted (an id out of
range, a duplicate, a missing block, a negative token count, a wrong group count) so the vectorized pass
must pick out exactly the bad ones and leave the others alone.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch_plan import step
from test_recipe_tail import assert_same

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout import CacheOptions, KVLayout, load_preset
from hybrid_transfer.plan.batch_checks import check_plans
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.plan.validate import RegionTable

TOPOLOGIES = [("qwen3.5-397b-a17b", 1, 1), ("qwen3.5-397b-a17b", 2, 8), ("qwen3.5-27b", 4, 1),
              ("qwen3.5-0.8b", 1, 2)]
POOL = 256
DEFECTS = ["none", "none", "local_range", "remote_range", "local_dup", "remote_dup", "short_remote",
           "negative_tokens", "groups", "local_negative"]


def _corrupt(defect: str, local: list[list[int]], remote: list[list[int]], n: int):
    local, remote = [list(g) for g in local], [list(g) for g in remote]
    if defect == "local_range":
        local[-1][0] = POOL + 3
    elif defect == "local_negative":
        local[0][0] = -1
    elif defect == "remote_range":
        remote[0][-1] = POOL
    elif defect == "local_dup":
        local[-1][0] = local[0][0]
    elif defect == "remote_dup":
        remote[1][0] = remote[0][0]
    elif defect == "short_remote":
        remote[0] = remote[0][:-1]
    elif defect == "negative_tokens":
        n = -1
    elif defect == "groups":
        local = local[:-1]
    return local, remote, n


def _outcome(planner: Planner, local, remote, n, mode):
    try:
        return planner.plan(local, remote, n, mode)
    except PlanError as exc:
        return exc


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(TOPOLOGIES), layout=st.sampled_from(list(KVLayout)),
       mode=st.sampled_from(list(PlanMode)),
       requests=st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([0.0, 1.0]), st.sampled_from(DEFECTS)),
                         min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_plan_many_gives_each_request_what_plan_gives_it_alone(topology, layout, mode, requests, seed):
    model, consumer, producers, clean = step(topology, layout, [(n, f) for n, f, _ in requests], seed, POOL)
    items = [_corrupt(defect, *item) for (_, _, defect), item in zip(requests, clean, strict=True)]
    got = Planner(model, consumer, producers).plan_many(items, mode)
    assert len(got) == len(items)
    for item, (_, _, defect), out in zip(items, requests, got, strict=True):
        alone = _outcome(Planner(model, consumer, producers), *item, mode)
        if isinstance(alone, PlanError):
            assert type(out) is type(alone) and str(out) == str(alone), (defect, out, alone)
        else:
            assert defect == "none" or not isinstance(out, PlanError)
            assert_same(out, alone, f"request ({defect})")


def test_check_plans_names_only_the_plan_whose_rows_leave_the_registered_regions():
    model = load_preset("qwen3.5-0.8b")
    producers = fake_engine(model, 1, CacheOptions(), POOL, 0)
    consumers = fake_engine(model, 1, CacheOptions(), POOL, 1)
    planner = Planner(model, consumers[0], producers)
    rng = np.random.default_rng(1)
    plans = [planner.plan(make_block_ids(blocks_needed(model, consumers[0].block_size, 3000), POOL, 1.0, rng),
                          make_block_ids(blocks_needed(model, producers[0].block_size, 3000), POOL, 1.0, rng), 3000)
             for _ in range(3)]
    src = plans[1].sources[0]
    src.local_addr[-1] += 1 << 40  # one row of the middle plan now points outside every registered region
    local = RegionTable(consumers[0].tensor_addrs, consumers[0].region_bytes)
    remote = {0: RegionTable(producers[0].tensor_addrs, producers[0].region_bytes)}
    errors = check_plans(plans, local, remote)
    assert errors[0] is None and errors[2] is None
    with pytest.raises(PlanError, match="local range"):
        raise errors[1]
