"""Aborts while a READ is in flight, with real NIXL agents on separate processes (loopback DRAM).

A READ is held in flight by pausing the producer's polling (see test_faults.py: on this host a
READ completes only once its target is progressed), so the abort lands while NIXL reports PROC.
"""

from __future__ import annotations

import time

import pytest
from harness import TINY, RankSpec, hold_everywhere, start_consumers, start_producers
from lifecycle_ops import abort, pause, resume, status, wait_results

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.verify import RequestLayout

WAIT_S = 30.0
LAYOUT = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
LOCAL = ((5, 6), (7,), (8,), (9,))


def _until(check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)
    return value


@pytest.fixture
def paused_read(cluster):
    """A producer and a consumer rank, linked and welcomed, and request "r" read while the producer is paused."""
    p_worker, c_worker = cluster.workers[0], cluster.workers[1]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)])
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 16)], EngineConfig(read_deadline_s=60.0))
    pk, ck = producers.keys[0], consumers.keys[0]
    paused = False
    try:
        c_worker.call("connect", ck, producers.addresses[0], 10.0)
        _until(lambda: c_worker.call("call", status, ck)["stats"]["welcomes"] == 1)
        ticket = hold_everywhere(producers, "r", LAYOUT, seed=9)
        p_worker.call("call", pause, pk)
        paused = True
        c_worker.call("start_read", ck, ticket, LOCAL, 20)
        c_worker.call("settle", 0.1)
        assert c_worker.call("call", status, ck, ["r"])["reads"]["r"] == ("reading", ["PROC"])

        def resume_producer():
            nonlocal paused
            p_worker.call("call", resume, pk)
            paused = False

        yield p_worker, pk, c_worker, ck, resume_producer
    finally:
        if paused:
            p_worker.call("call", resume, pk)
        consumers.close()
        producers.close()


def test_a_consumer_abort_mid_read_reports_only_once_the_handle_is_gone_and_frees_the_producer(paused_read):
    p_worker, pk, c_worker, ck, resume_producer = paused_read
    assert c_worker.call("call", abort, ck, "r")
    (result,) = c_worker.call("call", wait_results, ck, ["r"], WAIT_S).values()
    assert (result["state"], result["error_type"], result["local_block_ids"]) == (
        "aborted", "RequestAbortedError", LOCAL)
    st = c_worker.call("call", status, ck)
    assert (st["quarantined_blocks"], st["live_handles"], st["active"]) == (0, 0, 0)
    resume_producer()
    assert p_worker.call("wait_freed", pk, ["r"], WAIT_S) == ["r"]
    st = p_worker.call("call", status, pk)
    assert st["terminal"] == {"freed": 1} and st["stats"]["completions_aborted"] == 1 and st["pinned_blocks"] == 0


def test_a_producer_abort_mid_read_revokes_the_read_and_frees_after_the_ack(paused_read):
    p_worker, pk, c_worker, ck, resume_producer = paused_read
    assert p_worker.call("call", abort, pk, "r")
    assert p_worker.call("call", status, pk, ["r"])["holds"] == {"r": "aborting"}  # a consumer may be reading
    (result,) = c_worker.call("call", wait_results, ck, ["r"], WAIT_S).values()
    assert (result["state"], result["cause"], result["local_block_ids"]) == ("failed", "revoked", LOCAL)
    st = c_worker.call("call", status, ck)
    assert (st["quarantined_blocks"], st["live_handles"], st["stats"]["revokes"]) == (0, 0, 1)
    resume_producer()
    assert p_worker.call("wait_freed", pk, ["r"], WAIT_S) == ["r"]
    st = p_worker.call("call", status, pk)
    assert st["terminal"] == {"aborted": 1} and st["pinned_blocks"] == 0
    # The consumer told it twice: a FAILED completion (which ended the hold) and the revocation's ack.
    assert st["stats"]["completions_failed"] == 1 and st["stats"]["acks"] + st["stats"]["stale_acks"] == 1
