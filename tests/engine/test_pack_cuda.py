"""Pack mode with CUDA caches and staging (one GPU, ranks as processes): the CPU checks, on the device.

Skipped without CUDA (CI has none). On a GPU host run
``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y python -m pytest tests/engine/test_pack_cuda.py``; the variable
is set here too, before any worker starts, because without it UCX moves GPU bytes over TCP (docs/tuning.md#cuda-ipc).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")

from harness import TINY, RankSpec  # noqa: E402
from pack_ops import hold_on_every_rank, run_pack, slow_scatter_report, slow_scatters, start_engine, wait_results  # noqa: E402  # noqa: E402
from test_pack_ready import ready_notification_case  # noqa: E402
from test_transfer import TOPOLOGIES, _layouts  # noqa: E402

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


def test_cuda_ready_notification_carries_the_staged_range_for_pipelined_reads(cluster, tmp_path):
    """Reads posted before any gather wait for the Staged notification and read the range it carries."""
    ready_notification_case(cluster, tmp_path, False, "cuda")


def test_cuda_scatters_run_on_their_stream_overlap_later_reads_and_gate_done(cluster):
    """Every scatter is held ~20 ms behind a sleep kernel on the copier's stream: polls return at once, a later
    request's READ completes and its scatter is launched while an earlier one still runs, every request is
    reported DONE only after its scatter's event completed, and every byte lands."""
    tokens = (100, 90, 64, 37, 80)
    specs_p, specs_c = [RankSpec(TINY, 1, 0, 64)], [RankSpec(TINY, 1, 0, 64)]
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20)
    producers = start_engine(cluster.workers[:1], specs_p, config, "cuda", True)
    consumers = start_engine(cluster.workers[1:2], specs_c, config, "cuda", False)
    c_worker, c_key = consumers.workers[0], consumers.keys[0]
    try:
        c_worker.call("call", slow_scatters, c_key, 40_000_000)
        rng = np.random.default_rng(31)
        remote = _layouts(specs_p[0].geometry(), list(tokens), 64, rng, extra=0)
        local = _layouts(specs_c[0].geometry(), list(tokens), 64, rng, extra=1)
        ids = [f"slow-{i}" for i in range(len(tokens))]
        tickets = [hold_on_every_rank(producers, rid, lay, 500 + i) for i, (rid, lay) in enumerate(zip(ids, remote,
                                                                                                    strict=True))]
        for ticket, lay in zip(tickets, local, strict=True):  # all in flight on one consumer
            c_worker.call("start_read", c_key, ticket, lay.block_ids, lay.num_tokens)
        results = c_worker.call("call", wait_results, c_key, ids, 60.0)
        assert [r.state for r in results] == ["done"] * len(ids), results
        c_worker.call("check", c_key, [(lay, 500 + i) for i, lay in enumerate(local)])
        report = c_worker.call("call", slow_scatter_report, c_key)
        assert producers.workers[0].call("wait_freed", producers.keys[0], ids, 30.0) == sorted(ids)
    finally:
        producers.close()
        consumers.close()
    assert report["scatters"] == len(ids) and all(r.num_packed_sources == 1 for r in results)
    assert report["forgot_running"] == 0, report  # DONE never before the scatter's event
    assert max(report["running"]) > 0, report  # a later READ finished and scattered while earlier scatters ran
