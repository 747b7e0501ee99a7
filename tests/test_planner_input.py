"""A HybridCache as the planner sees it: its descriptor and its memory, for planning and dry runs."""

import numpy as np
import pytest

from hybrid_transfer import describe_cache, memory_space
from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import RankGeometry
from hybrid_transfer.plan import Planner, execute
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import check_destination, fill_source, make_request, poison


def test_descriptor_names_the_cache_regions_and_geometry(tiny_model):
    g = RankGeometry(tiny_model, 2, 1)
    cache = HybridCache.allocate(g, num_blocks=5)
    desc = describe_cache(cache)
    assert desc.tensor_addrs == tuple(t.data_ptr() for t in cache.tensors)
    assert (desc.tp_size, desc.tp_rank, desc.num_blocks, desc.page_bytes) == (2, 1, 5, g.page_bytes)
    assert (desc.is_cuda, desc.device_id) == (False, 0)


def test_memory_space_answers_for_the_cache_bytes(tiny_model):
    cache = HybridCache.allocate(RankGeometry(tiny_model, 1), num_blocks=3)
    space = memory_space(cache)
    t = cache.tensors[1]
    space.view(t.data_ptr() + 10, 4)[:] = 7  # writes land in the tensor itself
    assert t[10:14].tolist() == [7, 7, 7, 7] and int(t.sum()) == 28


def test_a_plan_built_and_run_from_caches_alone_moves_the_request(tiny_model):
    """TP2 -> TP1 with nothing but the two helpers between the caches and the planner."""
    pre = [HybridCache.allocate(RankGeometry(tiny_model, 2, r), num_blocks=8) for r in range(2)]
    dec = HybridCache.allocate(RankGeometry(tiny_model, 1), num_blocks=8)
    remote_req = make_request(pre[0].geometry, 37, 8, np.random.default_rng(1), 1.0)
    local_req = make_request(dec.geometry, 37, 8, np.random.default_rng(2), 1.0)
    for cache in pre:
        fill_source(cache, remote_req, seed=9)
    poison(dec)
    planner = Planner(tiny_model, describe_cache(dec), [describe_cache(c) for c in pre])
    plan = planner.plan(local_req.block_ids, remote_req.block_ids, 37, PlanMode.COALESCED)
    execute(plan, memory_space(dec), {r: memory_space(c) for r, c in enumerate(pre)})
    check_destination(dec, local_req, seed=9)


def test_memory_space_refuses_memory_numpy_cannot_see(tiny_model):
    cache = HybridCache.allocate(RankGeometry(tiny_model, 1), num_blocks=1, device="meta")
    with pytest.raises(ConfigError) as err:
        memory_space(cache)
    assert err.value.field == "device" and err.value.value == "meta"
