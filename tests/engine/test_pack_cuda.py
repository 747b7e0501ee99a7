"""Pack mode with CUDA caches and staging (one GPU, ranks as processes): the CPU checks, on the device.

Skipped without CUDA (CI has none). On a GPU host run
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python -m pytest tests/engine/test_pack_cuda.py``; the variable
is set here too, before any worker starts, because without it UCX moves GPU bytes over TCP (docs/tuning.md#cuda-ipc).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")

from pack_ops import run_pack  # noqa: E402
from test_transfer import TOPOLOGIES  # noqa: E402

from hybrid_transfer.engine import EngineConfig  # noqa: E402
from hybrid_transfer.engine.config import CostParams  # noqa: E402
from hybrid_transfer.plan.types import PlanMode  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda unavailable)")

TOKENS = (37, 64, 1, 0, 100)


@pytest.mark.parametrize("topology", ["1->2", "2->1", "2->4", "4->2"])
def test_cuda_pack_transfer_is_bitwise_exact(cluster, topology):
    p, d, p_opts, c_opts = TOPOLOGIES[topology]
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20)
    results, p_status, c_status, _ = run_pack(cluster, p, d, p_opts, c_opts, config, device="cuda",
                                              token_counts=TOKENS)
    for per_rank in results:
        for r, n in zip(per_rank, TOKENS, strict=True):
            assert r.num_fallback_sources == 0 and (r.num_packed_sources > 0) == (n > 0), r
    assert all(s["bytes_in_use"] == 0 for s in p_status + c_status)


def test_cuda_pack_of_a_real_preset_geometry_with_fragmented_blocks(cluster):
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=64 << 20)
    results, _, c_status, _ = run_pack(cluster, 1, 2, None, None, config, device="cuda", model="qwen3.5-0.8b",
                                       num_blocks=24, token_counts=(600, 700, 0))  # the 700 are fragmented
    assert [r.num_packed_sources for r in results[0]] == [1, 1, 0]
    assert all(r.gather_s > 0 and r.scatter_s > 0 for r in results[0] if r.num_packed_sources)
    assert all(s["bytes_in_use"] == 0 for s in c_status)


def test_cuda_pools_too_small_fall_back_and_auto_follows_its_costs(cluster):
    tiny = EngineConfig(mode=PlanMode.PACK, staging_bytes=1024)
    results, _, c_status, _ = run_pack(cluster, 1, 1, None, None, tiny, device="cuda", token_counts=(100, 90),
                                       producer_config=EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20))
    assert c_status[0]["stats"]["fallback_pool_full"] == 2
    cost = CostParams(per_descriptor_s=1e-3, per_byte_s=1e-12, copy_per_byte_s=1e-12, per_piece_copy_s=1e-9,
                      copy_launch_s=1e-6)
    auto = EngineConfig(mode=PlanMode.AUTO, staging_bytes=1 << 20, cost=cost)
    results, _, _, choices = run_pack(cluster, 2, 1, None, None, auto, device="cuda", token_counts=TOKENS)
    assert [r.num_packed_sources for r in results[0]] == choices[0] and sum(choices[0]) > 0
