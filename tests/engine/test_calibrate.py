"""Auto's model at consumer start: the memory's preset (one model on every start), given costs, or a calibration
(real loopback READs and gathers give a usable cost model; a too-small pool is refused)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.config import CostParams
from hybrid_transfer.engine.pack.calibrate import calibrate, cost_model
from hybrid_transfer.engine.pack.gather_scatter import Arena, Copier
from hybrid_transfer.engine.pack.staging import StagingPool
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, make_block_ids
from hybrid_transfer.plan.types import PlanMode

MODEL = model_from_config(TINY, name="tiny")


def test_calibration_measures_positive_finite_costs_and_frees_its_probes():
    cache = HybridCache.allocate(RankGeometry(MODEL, 1, 0), 1024)  # 1 MiB tensors to gather from
    agent = NixlAgent("calibrate-test", EngineConfig())
    try:
        agent.register(cache.regions)
        pool = StagingPool(2 << 20)
        agent.register_more([pool.region])
        params = calibrate(agent, pool, Copier(Arena(cache.tensors)), probe_bytes=1 << 20, repeats=2)
        assert pool.bytes_in_use == 0
        values = [getattr(params, f) for f in CostParams.__struct_fields__]
        assert all(math.isfinite(v) and v >= 0 for v in values), params
        assert params.per_byte_s > 0 and params.copy_per_byte_s > 0 and params.copy_launch_s > 0
        model = cost_model(params)
        # Whatever the figures, a million tiny descriptors cost more than one READ of the same bytes.
        assert model.direct_s(1_000_000, 1 << 20) > model.direct_s(1, 1 << 20)
        with pytest.raises(ConfigError):
            calibrate(agent, StagingPool(4096), Copier(Arena(cache.tensors)))
    finally:
        agent.close()


def test_an_auto_consumer_starts_with_its_memorys_preset_given_costs_or_on_request_a_calibration():
    from hybrid_transfer.plan.cost import HOST_COST

    cache = HybridCache.allocate(RankGeometry(MODEL, 1, 0), 64)
    given = CostParams(per_descriptor_s=1.0)
    with Consumer(cache, EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20, cost=given)) as c:
        assert c.cost_model == cost_model(given)
    with Consumer(cache, EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20)) as c:
        assert c.cost_model == HOST_COST  # a host cache, nothing measured
    with Consumer(cache, EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20, calibrate=True)) as c:
        measured = c.cost_model
        assert measured != HOST_COST and measured.pack_fixed_s == HOST_COST.pack_fixed_s


def test_auto_consumers_started_again_and_again_choose_one_mode_per_shape():
    """Issue 20: auto flipped between rounds because every consumer start calibrated (each rank its own,
    noisy figures) and chose per request from its ids. Five starts (a bench round each) plan one shape,
    fragmented and contiguous, with one model and one mode for every request."""
    geometry = RankGeometry(MODEL, 1, 0)
    cache = HybridCache.allocate(geometry, 64)
    models, modes = set(), set()
    for _ in range(5):
        with Consumer(cache, EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20)) as c:
            models.add(c.cost_model)
            descriptor = c.descriptor
            planner = Planner(MODEL, descriptor, [descriptor], cost=c.cost_model)
            rng = np.random.default_rng(len(models))
            for fragmentation in (0.0, 0.5, 1.0):
                ids = make_block_ids(blocks_needed(MODEL, descriptor.block_size, 300), 64, fragmentation, rng)
                plan = planner.plan(ids, ids, 300, PlanMode.AUTO)
                modes.add(tuple(plan.meta["source_modes"].values()))
    assert len(models) == 1, models
    assert len(modes) == 1, modes
