"""Processes killed with SIGKILL (real NIXL, separate processes, loopback DRAM): the survivors end every
request on time and get every block back.

What "mid-read" means on this CPU host: a loopback READ over UCX shared memory finishes only once
the target process is progressed, so a READ from a producer that has stopped polling stays in PROC
(its bytes may already have landed, NIXL has not said so). The test stops the producer's polling,
posts the READ, checks that NIXL still reports it PROC after several consumer polls, then kills the
producer: as far as anything can tell, the READ is in flight. A second ticket was issued before the
kill and read after it (the producer died between ticket and post, after the handshake); a third
consumer, which never handshaked, cannot make its handshake at all.

Producer clocks here are ManualClocks the test advances (lifecycle_ops.py), so lease expiry
happens when the test says, not when a loaded machine gets round to it.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from harness import (
    TINY,
    EngineRanks,
    RankSpec,
    Worker,
    hold_everywhere,
    start_consumers,
    start_producers,
    worker_context,
)
from lifecycle_ops import advance_clock, create_producer, pause, resume, status, wait_results

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.verify import RequestLayout

WAIT_S = 30.0


@pytest.fixture(scope="module")
def victims():
    """Fresh workers of their own, started together: the tests kill them."""
    ctx = worker_context()
    workers = [Worker(ctx, 100 + i) for i in range(2)]
    yield workers
    for w in workers:
        w.close()


def _until(what: str, check, timeout_s: float = WAIT_S):
    """Ask ``check`` until it returns something truthy (each call is a round trip to a polling worker)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _kill(worker: Worker) -> None:
    os.kill(worker.process.pid, signal.SIGKILL)
    worker.process.join(timeout=30)
    assert worker.process.exitcode == -signal.SIGKILL


def test_producer_killed_mid_read_fails_reads_with_every_block_id_and_returns_the_blocks(cluster, victims):
    victim, c_worker, p_worker, stranger = victims[0], cluster.workers[1], cluster.workers[0], cluster.workers[2]
    spec = RankSpec(TINY, 1, 0, 16)
    producers = start_producers([victim], [spec])
    config = EngineConfig(read_deadline_s=60.0, handshake_timeout_s=2.0)
    consumers = start_consumers([c_worker], [spec], config)
    late = start_consumers([stranger], [spec], config)
    others = None
    ck, pk = consumers.keys[0], producers.keys[0]
    try:
        c_worker.call("connect", ck, producers.addresses[0], 10.0)
        _until("the welcome", lambda: c_worker.call("call", status, ck)["stats"]["welcomes"] == 1)
        mid = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
        after = RequestLayout(((5, 6), (7,), (8,), (9,)), 30)
        local_mid, local_after = ((10, 11), (12,), (13,), (14,)), ((0, 1, 2), (3,), (4,), (5,))
        t_mid = hold_everywhere(producers, "mid", mid, seed=1)
        t_after = hold_everywhere(producers, "after", after, seed=2)
        victim.call("call", pause, pk)
        c_worker.call("start_read", ck, t_mid, local_mid, 20)
        c_worker.call("settle", 0.2)
        assert c_worker.call("call", status, ck, ["mid"])["reads"]["mid"] == ("reading", ["PROC"])
        _kill(victim)
        c_worker.call("start_read", ck, t_after, local_after, 30)
        stranger.call("start_read", late.keys[0], t_after, local_after, 30)
        results = c_worker.call("call", wait_results, ck, ["mid", "after"], WAIT_S)
        for rid, local in (("mid", local_mid), ("after", local_after)):
            r = results[rid]
            assert r is not None and (r["state"], r["cause"], r["error_type"]) == (
                "failed", "source_lost", "SourceLostError"), r
            assert r["local_block_ids"] == local and r["elapsed_s"] < config.read_deadline_s
        (never,) = stranger.call("call", wait_results, late.keys[0], ["after"], WAIT_S).values()
        assert (never["state"], never["cause"], never["local_block_ids"]) == ("failed", "handshake", local_after)
        st = c_worker.call("call", status, ck)
        assert (st["quarantined_blocks"], st["live_handles"], st["active"]) == (0, 0, 0)
        assert st["failure_causes"] == {"source_lost": 2}
        # The blocks are back: the same local blocks take a new request from a live producer, byte for byte.
        others = start_producers([p_worker], [spec])
        ticket = hold_everywhere(others, "again", mid, seed=3)
        c_worker.call("start_read", ck, ticket, local_mid, 20)
        assert c_worker.call("wait_done", ck, ["again"], WAIT_S)[0].state == "done"
        c_worker.call("check", ck, [(RequestLayout(local_mid, 20), 3)])
        assert p_worker.call("wait_freed", others.keys[0], ["again"], WAIT_S) == ["again"]
    finally:
        consumers.close()
        late.close()
        if others is not None:
            others.close()


def test_consumer_killed_its_leases_run_out_after_outliving_their_first_expiry(cluster, victims):
    """2 -> 1 fan-in: the READ from rank 1 hangs (rank 1 stopped polling), rank 0 hears heartbeats.

    The producers' liveness probes are off (test_reclaim.py has them on): rank 0, which answered the
    claim before the kill, sees no sign of the death, and its lease is what gives the blocks back."""
    victim, p_workers = victims[1], cluster.workers[:2]
    lease_s = 10.0
    engine_id, incarnation = f"prefill-{uuid.uuid4().hex[:6]}", int.from_bytes(os.urandom(6), "little")
    specs = [RankSpec(TINY, 2, r, 16) for r in range(2)]
    keys = [f"{engine_id}-{r}" for r in range(2)]
    p_config = EngineConfig(lease_s=lease_s, peer_probe_s=0.0)  # no probes: the lease as the last resort
    addresses = [w.call("call", create_producer, k, s, engine_id, incarnation, p_config, True)
                 for w, k, s in zip(p_workers, keys, specs, strict=True)]
    for w, k in zip(p_workers, keys, strict=True):
        w.call("set_engine_addresses", k, addresses)
    producers = EngineRanks(list(p_workers), keys, specs, addresses, engine_id, incarnation)
    c_config = EngineConfig(lease_s=lease_s, heartbeat_interval_s=0.05, read_deadline_s=600.0)
    consumers = start_consumers([victim], [RankSpec(TINY, 1, 0, 16)], c_config)
    ck, (w0, w1), (k0, k1) = consumers.keys[0], p_workers, keys
    paused = False
    try:
        victim.call("connect", ck, addresses[0], 10.0)
        _until("both welcomes", lambda: victim.call("call", status, ck)["stats"]["welcomes"] == 2)
        layout = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
        ticket = hold_everywhere(producers, "r", layout, seed=5)  # both clocks at 0: leases end at 10
        w1.call("call", pause, k1)
        paused = True
        victim.call("start_read", ck, ticket, [[5, 6], [7], [8], [9]], 20)
        def read_state():
            state, handles = victim.call("call", status, ck, ["r"])["reads"]["r"]
            return (state, sorted(handles)) if "DONE" in handles else None

        assert _until("the READ from rank 0", read_state) == ("reading", ["DONE", "PROC"])
        assert w0.call("call", status, k0, ["r"])["expires_at"] == {"r": lease_s}
        assert w0.call("call", advance_clock, k0, lease_s - 1.0) == 9.0
        _until("a renewal at t=9", lambda: w0.call("call", status, k0, ["r"])["expires_at"]["r"] == 9.0 + lease_s)
        w0.call("call", advance_clock, k0, 6.0)  # t=15: past the first expiry
        w0.call("settle", 0.1)
        st = w0.call("call", status, k0, ["r"])
        assert st["holds"] == {"r": "held"} and st["pinned_blocks"] == 5
        _kill(victim)
        w0.call("settle", 0.3)  # heartbeats sent before the kill are in; none come after it
        renewals = w0.call("call", status, k0)["stats"]["renewals"]
        w0.call("call", advance_clock, k0, lease_s + 0.01)  # one lease after the last possible renewal (t=15)
        assert w0.call("wait_freed", k0, ["r"], WAIT_S) == ["r"]
        st = w0.call("call", status, k0, ["r"])
        assert st["terminal"] == {"expired": 1} and st["pinned_blocks"] == 0 and st["held_requests"] == 0
        assert st["stats"]["renewals"] == renewals  # the dead consumer renewed nothing more
        w1.call("call", resume, k1)
        paused = False
        # Rank 1 takes in the claim sent before the kill only now: NIXL refuses its answer to the dead
        # agent as disconnected, which is a sign even with probes off, so the hold is reclaimed while
        # rank 1's clock still reads t=0 (docs/lifecycle.md#reclaim).
        assert w1.call("wait_freed", k1, ["r"], WAIT_S) == ["r"]
        st = w1.call("call", status, k1)
        assert st["terminal"] == {"aborted": 1}
        assert (st["stats"]["peers_lost"], st["stats"]["reclaims"]) == (1, 1)
    finally:
        if paused:
            w1.call("call", resume, k1)
        producers.close()
