"""Pack mode's ready notification, over real NIXL between processes (CPU DRAM).

The staged range travels in the producer's Staged notification: a consumer that posted before the
gather waits for it and then reads, several requests in flight at once, with nothing asked over the
side channel after the handshake. The test process plays the scheduler: tickets exist before any
rank holds (and so before any gather), as with vLLM.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from api_ops import fill, hold_ticket_and_poll, rank_card
from harness import TINY, WAIT_POLL_S, RankSpec
from pack_ops import hold_on_every_rank, pack_status, start_engine, wait_results
from test_transfer import TOPOLOGIES, _layouts

from hybrid_transfer.engine import EngineCard, EngineConfig, encode_ticket, issue_ticket
from hybrid_transfer.plan.types import PlanMode

TOKENS = (37, 64, 100, 50)
NUM_BLOCKS = 64


def wait_reading(state, key, request_ids, timeout_s) -> list[str]:
    """Poll until every request is READING (its sources posted: waiting for their Staged notifications)."""
    rank = state.ranks[key]
    deadline = time.monotonic() + timeout_s
    states = []
    while time.monotonic() < deadline:
        state.poll_all()
        states = [rank.engine._requests[r].state.value if r in rank.engine._requests else
                  f"{rank.results[r].state.value}: {rank.results[r].error}" for r in request_ids]
        if all(s == "reading" for s in states):
            break
        time.sleep(WAIT_POLL_S)
    return states


def side_channel_counts(state, key) -> dict:
    stats = state.ranks[key].engine.listener_stats
    return {"accepted": stats.accepted, "rejected": stats.rejected, "garbage": stats.garbage}


@pytest.mark.parametrize("sealed", [False, True], ids=["open", "secret"])
def test_pipelined_reads_wait_for_the_staged_range_in_the_ready_notification(cluster, tmp_path, sealed):
    """With a shared secret the Staged notifications are sealed like every other one."""
    ready_notification_case(cluster, tmp_path, sealed, "cpu")


def ready_notification_case(cluster, tmp_path, sealed: bool, device: str) -> None:
    """Tickets before any gather, every read posted and waiting, then the holds: each source reads the
    range its Staged notification carried, bitwise, with no query over the side channel (test_pack_cuda too)."""
    p, d, p_opts, c_opts = TOPOLOGIES["2->1"]  # fan-in, block sizes that differ between the sides
    p_specs = [RankSpec(TINY, p, r, NUM_BLOCKS, p_opts) for r in range(p)]
    c_specs = [RankSpec(TINY, d, 0, NUM_BLOCKS, c_opts)]
    key = b"pack-ready-test-secret-of-32-byte" if sealed else None
    secret = tmp_path / "secret"
    if sealed:
        secret.write_bytes(key + b"\n")
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20, secret_file=str(secret) if sealed else None)
    producers = start_engine(cluster.workers[:p], p_specs, config, device, True)
    consumers = start_engine(cluster.workers[p:p + 1], c_specs, config, device, False)
    c_worker, c_key = consumers.workers[0], consumers.keys[0]
    try:
        rng = np.random.default_rng(21)
        remote = _layouts(p_specs[0].geometry(), list(TOKENS), NUM_BLOCKS, rng, extra=0)
        local = _layouts(c_specs[0].geometry(), list(TOKENS), NUM_BLOCKS, rng, extra=1)
        card = EngineCard.from_ranks({r: w.call("call", rank_card, k)
                                      for r, (w, k) in enumerate(zip(producers.workers, producers.keys, strict=True))})
        ids = [f"req-{i}" for i in range(len(TOKENS))]
        tickets = [encode_ticket(issue_ticket(card, rid, lay.block_ids, lay.num_tokens, secret=key))
                   for rid, lay in zip(ids, remote, strict=True)]
        for ticket, lay in zip(tickets, local, strict=True):  # every request in flight before any gather
            c_worker.call("start_read", c_key, ticket, lay.block_ids, lay.num_tokens)
        assert c_worker.call("call", wait_reading, c_key, ids, 60.0) == ["reading"] * len(ids)
        for i, (ticket, lay) in enumerate(zip(tickets, remote, strict=True)):
            for w, k in zip(producers.workers, producers.keys, strict=True):
                w.call("call", fill, k, lay, 700 + i)
                w.call("call", hold_ticket_and_poll, k, ticket)  # gathers, then tells the consumer agent
        results = c_worker.call("call", wait_results, c_key, ids, 60.0)
        assert [r.state for r in results] == ["done"] * len(ids), results
        c_worker.call("check", c_key, [(lay, 700 + i) for i, lay in enumerate(local)])
        for w, k in zip(producers.workers, producers.keys, strict=True):
            assert w.call("wait_freed", k, ids, 30.0) == sorted(ids)
        status = c_worker.call("call", pack_status, c_key)
        channel = [w.call("call", side_channel_counts, k) for w, k in zip(producers.workers, producers.keys,
                                                                            strict=True)]
    finally:
        producers.close()
        consumers.close()
    for r in results:
        assert (r.num_packed_sources, r.num_fallback_sources) == (p, 0), r
        assert r.num_descriptors <= 2 * p
    stats = status["stats"]
    # Every source of every request waited for its notification, then read the range it carried.
    assert stats["notes_waited"] == stats["packed_sources"] == p * len(ids), stats
    assert stats["notes_ready"] == 0 and stats["fallback_unannounced"] == 0 and stats["fallback_absent"] == 0
    assert status["bytes_in_use"] == 0
    # The side channel served the handshake and nothing else: no staging query crossed it.
    assert channel == [{"accepted": 1, "rejected": 0, "garbage": 0}] * p, channel


def drop_announcements(state, key) -> None:
    """This producer rank stages as usual but never sends its Staged notifications (they get lost)."""
    state.ranks[key].engine._announce_staged = lambda: None


def test_a_lost_notification_costs_a_direct_read_not_the_request(cluster):
    """No Staged notification within STAGED_WAIT_S: the source is read directly, bitwise exact, counted."""
    p_specs = [RankSpec(TINY, 1, 0, NUM_BLOCKS)]
    c_specs = [RankSpec(TINY, 1, 0, NUM_BLOCKS)]
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20)
    producers = start_engine(cluster.workers[:1], p_specs, config, "cpu", True)
    consumers = start_engine(cluster.workers[1:2], c_specs, config, "cpu", False)
    c_worker, c_key = consumers.workers[0], consumers.keys[0]
    try:
        producers.workers[0].call("call", drop_announcements, producers.keys[0])
        rng = np.random.default_rng(22)
        remote = _layouts(p_specs[0].geometry(), [37, 64], NUM_BLOCKS, rng, extra=0)
        local = _layouts(c_specs[0].geometry(), [37, 64], NUM_BLOCKS, rng, extra=1)
        ids = ["lost-0", "lost-1"]
        tickets = [hold_on_every_rank(producers, rid, lay, 900 + i) for i, (rid, lay) in enumerate(zip(ids, remote,
                                                                                                     strict=True))]
        for ticket, lay in zip(tickets, local, strict=True):
            c_worker.call("start_read", c_key, ticket, lay.block_ids, lay.num_tokens)
        results = c_worker.call("call", wait_results, c_key, ids, 60.0)
        assert [r.state for r in results] == ["done"] * 2, results
        c_worker.call("check", c_key, [(lay, 900 + i) for i, lay in enumerate(local)])
        status = c_worker.call("call", pack_status, c_key)
    finally:
        producers.close()
        consumers.close()
    assert [(r.num_packed_sources, r.num_fallback_sources) for r in results] == [(0, 1)] * 2
    stats = status["stats"]
    assert stats["fallback_unannounced"] == 2 and stats["notes"] == 0 and stats["packed_sources"] == 0, stats
