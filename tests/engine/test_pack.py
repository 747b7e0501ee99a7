"""Pack mode over real NIXL between processes (CPU DRAM): staged, read, scattered, bitwise exact.

Each case holds five requests (contiguous and fragmented blocks, partial last blocks, one token,
zero tokens), reads them on every consumer rank, checks every byte against the global-coordinate
oracle, and checks that every staging slice went back to its pool on both sides.
"""

from __future__ import annotations

import pytest
from pack_ops import run_pack, start_log_capture, stop_log_capture
from test_transfer import TOPOLOGIES

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.engine.config import CostParams
from hybrid_transfer.plan.types import PlanMode

TOKENS = (37, 64, 1, 0, 100)
POOL = 1 << 20  # the tiny model's requests are a few KiB per rank


def _sources_per_request(prefill_tp: int, decode_tp: int, num_tokens: int) -> int:
    return 0 if num_tokens == 0 else max(1, prefill_tp // decode_tp)


@pytest.mark.parametrize("topology", ["1->2", "2->1", "2->4", "4->2"])
def test_pack_transfer_is_bitwise_exact_and_reads_two_ranges_per_source(cluster, topology):
    """Fan-out and fan-in, with block and kernel block sizes that differ between the sides."""
    p, d, p_opts, c_opts = TOPOLOGIES[topology]
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=POOL)
    results, p_status, c_status, _ = run_pack(cluster, p, d, p_opts, c_opts, config, token_counts=TOKENS)
    for per_rank in results:
        for r, n in zip(per_rank, TOKENS, strict=True):
            sources = _sources_per_request(p, d, n)
            assert (r.num_packed_sources, r.num_fallback_sources) == (sources, 0), r
            assert r.num_descriptors <= 2 * sources
            assert r.post_to_done_s >= r.read_s >= 0 and r.scatter_s >= 0
    assert all(s["bytes_in_use"] == 0 and s["num_slices"] == 0 for s in p_status), p_status
    assert sum(s["stats"]["staged"] for s in p_status) == p * sum(n > 0 for n in TOKENS)
    assert all(s["bytes_in_use"] == 0 and s["stats"]["fallback_absent"] == 0 for s in c_status), c_status


def test_pack_of_a_real_preset_geometry(cluster):
    """qwen3.5-0.8b fans out 1 -> 2 with pages of about 1 MiB: real piece sizes, one KiB-aligned row width."""
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=32 << 20)
    results, _, c_status, _ = run_pack(cluster, 1, 2, None, None, config, model="qwen3.5-0.8b", num_blocks=12,
                                       token_counts=(600, 0))
    assert [r.num_packed_sources for r in results[0]] == [1, 0]
    assert all(s["bytes_in_use"] == 0 for s in c_status)


def test_full_staging_pools_fall_back_to_direct_reads_and_still_verify(cluster):
    """A producer pool for one request at a time, a consumer pool too small for any read.

    The producer stages what fits when it holds a request and answers ABSENT for the rest; the
    consumer reads those directly, and reads directly whatever its own pool cannot take.
    """
    tokens = (100, 90, 80, 70)
    producer = EngineConfig(mode=PlanMode.PACK, staging_bytes=16 << 10)  # one tiny request of ~7-14 KiB
    consumer = EngineConfig(mode=PlanMode.PACK, staging_bytes=POOL)
    results, p_status, c_status, _ = run_pack(cluster, 1, 1, None, None, consumer, producer_config=producer,
                                              token_counts=tokens, seed=3)
    staged, full = p_status[0]["stats"]["staged"], p_status[0]["stats"]["pool_full"]
    assert staged >= 1 and full >= 1 and staged + full == len(tokens), p_status
    assert sum(r.num_packed_sources for r in results[0]) == staged
    assert sum(r.num_fallback_sources for r in results[0]) == full == c_status[0]["stats"]["fallback_absent"]

    tiny_pool = EngineConfig(mode=PlanMode.PACK, staging_bytes=1024)
    results, p_status, c_status, _ = run_pack(cluster, 1, 1, None, None, tiny_pool,
                                              producer_config=EngineConfig(mode=PlanMode.PACK, staging_bytes=POOL),
                                              token_counts=tokens, seed=4)
    assert c_status[0]["stats"]["fallback_pool_full"] == len(tokens)
    assert all(r.num_fallback_sources == 1 and r.num_packed_sources == 0 for r in results[0])
    assert p_status[0]["bytes_in_use"] == 0


@pytest.mark.parametrize("per_descriptor_s", [1e-3, 0.0], ids=["pack-wins", "direct-wins"])
def test_auto_follows_the_cost_model(cluster, per_descriptor_s):
    """With costly descriptors every multi-descriptor source is packed; with free ones none is."""
    cost = CostParams(per_descriptor_s=per_descriptor_s, per_byte_s=1e-12, copy_per_byte_s=1e-12,
                      per_piece_copy_s=1e-9, copy_launch_s=1e-6)
    config = EngineConfig(mode=PlanMode.AUTO, staging_bytes=POOL, cost=cost)
    results, _, _, choices = run_pack(cluster, 2, 1, None, None, config, token_counts=TOKENS, seed=5)
    packed = [r.num_packed_sources for r in results[0]]
    assert packed == choices[0]
    assert (sum(packed) > 0) == (per_descriptor_s > 0)
    assert all(r.num_fallback_sources == 0 for r in results[0])


def test_a_pack_consumer_says_once_that_a_producer_does_not_stage(cluster):
    """Producers in direct mode cannot answer a staging query: the consumer reads directly, says so in
    every result and warns once per producer rank, not once per request."""
    tokens = (37, 64, 100)
    consumer_worker = cluster.workers[2]  # run_pack puts the decode rank after the two prefill ranks
    logger = "hybrid_transfer.engine.pack.reader"
    consumer_worker.call("call", start_log_capture, logger)
    try:
        pack = EngineConfig(mode=PlanMode.PACK, staging_bytes=POOL)
        results, _, c_status, _ = run_pack(cluster, 2, 1, None, None, pack, producer_config=EngineConfig(),
                                           token_counts=tokens, seed=6)
    finally:
        warnings = consumer_worker.call("call", stop_log_capture, logger)
    for r in results[0]:  # every byte was checked against the oracle inside run_pack
        assert (r.num_packed_sources, r.num_fallback_sources, r.unstaged_sources) == (0, 2, (0, 1)), r
    stats = c_status[0]["stats"]
    assert stats["fallback_unstaged"] == 2 * len(tokens) and stats["fallback_absent"] == 0, stats
    said = [w for w in warnings if "does not stage" in w]
    assert len(said) == 2 and all(any(f" rank {r} at " in w for w in said) for r in (0, 1)), warnings
