"""Calibration: real loopback READs and gathers give a usable cost model; a too-small pool is refused."""

from __future__ import annotations

import math

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


def test_an_auto_consumer_calibrates_at_start_unless_given_costs():
    cache = HybridCache.allocate(RankGeometry(MODEL, 1, 0), 64)
    given = CostParams(per_descriptor_s=1.0)
    with Consumer(cache, EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20, cost=given)) as c:
        assert c.cost_model == cost_model(given)
    with Consumer(cache, EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20)) as c:
        assert c.cost_model != cost_model(CostParams())
