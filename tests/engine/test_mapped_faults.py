"""Faults on the mapped read path end as on the NIXL path (issue 28), with no copy once a mapping is invalid.

Each test runs the same scenario twice, over NIXL and over a shared-memory mapping of the producer's
cache (real worker processes, real NIXL agents for handshakes and notifications, real shared memory),
and compares how every request ended. On a CPU host a mapped READ copies inside its post (like UCX's
cma path), so "mid-read" here is a request whose bytes moved and whose claim the producer has not
answered (its producer stopped polling). "No copy" is checked on the consumer: the mapping's copy count
and a digest of the request's local pages, taken before and after.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from harness import (
    TINY,
    RankSpec,
    RemoteError,
    Worker,
    hold_everywhere,
    start_consumers,
    start_producers,
    worker_context,
)
from lifecycle_ops import abort, pause, resume, status, wait_results
from mapped_ops import blocks_digest, producer_abort, transports

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.verify import RequestLayout

WAIT_S = 30.0
SPEC = RankSpec(TINY, 1, 0, 16, shared=True)
MID = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
AFTER = RequestLayout(((5, 6), (7,), (8,), (9,)), 30)
LOCAL_MID, LOCAL_AFTER = ((10, 11), (12,), (13,), (14,)), ((0, 1, 2), (3,), (4,), (5,))
TRANSPORTS = ("nixl", "mapped")


def _configs(secret_file, transport):
    producer = EngineConfig(secret_file=secret_file)
    consumer = EngineConfig(secret_file=secret_file, read_transport=transport, read_deadline_s=60.0,
                            handshake_timeout_s=2.0)
    return producer, consumer


def _until(what, check, timeout_s=WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def _ended(results):
    return {rid: (r["state"], r["cause"], r["error_type"]) for rid, r in results.items()}


def _linked(cw, ck, address):
    cw.call("connect", ck, address, 10.0)
    _until("the welcome", lambda: cw.call("call", status, ck)["stats"]["welcomes"] >= 1)


def test_an_abort_while_the_claim_is_unanswered_ends_alike(cluster, secret_file):
    abort_case(cluster, secret_file, SPEC, "shm")


def abort_case(cluster, secret_file, spec, kind):
    pw, cw = cluster.workers[0], cluster.workers[1]
    ended = {}
    for transport in TRANSPORTS:
        p_cfg, c_cfg = _configs(secret_file, transport)
        producers, consumers = start_producers([pw], [spec], p_cfg), start_consumers([cw], [spec], c_cfg)
        pk, ck = producers.keys[0], consumers.keys[0]
        try:
            _linked(cw, ck, producers.addresses[0])
            ticket = hold_everywhere(producers, "a", MID, seed=1)
            pw.call("call", pause, pk)
            cw.call("start_read", ck, ticket, LOCAL_MID, 20)
            cw.call("settle", 0.2)
            assert cw.call("call", abort, ck, "a")
            pw.call("call", resume, pk)
            ended[transport] = _ended(cw.call("call", wait_results, ck, ["a"], WAIT_S))
            assert pw.call("wait_freed", pk, ["a"], WAIT_S) == ["a"]
            t = cw.call("call", transports, ck)
            assert t["live_handles"] == 0 and cw.call("call", status, ck)["quarantined_blocks"] == 0
            assert set(t["links"].values()) == {"nixl" if transport == "nixl" else kind}
        finally:
            producers.close()
            consumers.close()
    assert ended["mapped"] == ended["nixl"] == {"a": ("aborted", None, "RequestAbortedError")}


def test_a_revoked_ticket_ends_alike(cluster, secret_file):
    revoke_case(cluster, secret_file, SPEC)


def revoke_case(cluster, secret_file, spec):
    pw, cw = cluster.workers[0], cluster.workers[1]
    ended = {}
    for transport in TRANSPORTS:
        p_cfg, c_cfg = _configs(secret_file, transport)
        producers, consumers = start_producers([pw], [spec], p_cfg), start_consumers([cw], [spec], c_cfg)
        pk, ck = producers.keys[0], consumers.keys[0]
        try:
            _linked(cw, ck, producers.addresses[0])
            ticket = hold_everywhere(producers, "r", MID, seed=2)
            assert pw.call("call", producer_abort, pk, "r")
            pw.call("settle", 0.2)
            cw.call("start_read", ck, ticket, LOCAL_MID, 20)
            ended[transport] = _ended(cw.call("call", wait_results, ck, ["r"], WAIT_S))
            assert cw.call("call", transports, ck)["live_handles"] == 0
            assert pw.call("call", status, pk)["pinned_blocks"] == 0
        finally:
            producers.close()
            consumers.close()
    assert ended["mapped"] == ended["nixl"]
    assert ended["nixl"]["r"][0] == "failed"


def test_a_killed_producer_ends_alike_and_nothing_is_copied_from_its_mapping_afterwards(cluster, secret_file):
    killed_case(cluster, secret_file, SPEC, "shm")


def killed_case(cluster, secret_file, spec, kind):
    cw = cluster.workers[1]
    ctx = worker_context()
    ended = {}
    for n, transport in enumerate(TRANSPORTS):
        victim = Worker(ctx, 200 + n)
        p_cfg, c_cfg = _configs(secret_file, transport)
        consumers = None
        try:
            producers = start_producers([victim], [spec], p_cfg)
            consumers = start_consumers([cw], [spec], c_cfg)
            pk, ck = producers.keys[0], consumers.keys[0]
            _linked(cw, ck, producers.addresses[0])
            t_mid = hold_everywhere(producers, "mid", MID, seed=3)
            t_after = hold_everywhere(producers, "after", AFTER, seed=4)
            victim.call("call", pause, pk)
            cw.call("start_read", ck, t_mid, LOCAL_MID, 20)
            cw.call("settle", 0.2)
            before = cw.call("call", blocks_digest, ck, LOCAL_AFTER)
            copies = cw.call("call", transports, ck)["copies"]
            os.kill(victim.process.pid, signal.SIGKILL)
            victim.process.join(timeout=30)
            cw.call("start_read", ck, t_after, LOCAL_AFTER, 30)
            results = cw.call("call", wait_results, ck, ["mid", "after"], WAIT_S)
            ended[transport] = _ended(results)
            assert all(r["elapsed_s"] < c_cfg.read_deadline_s for r in results.values())
            t = cw.call("call", transports, ck)
            assert t["live_handles"] == 0 and cw.call("call", status, ck)["quarantined_blocks"] == 0
            if transport == "mapped":
                assert list(copies.values()) == [1]  # "mid" was copied before the kill ...
                assert t["mapped"] == {}  # ... the mapping is invalid since ...
                assert cw.call("call", blocks_digest, ck, LOCAL_AFTER) == before  # ... and "after" never copied
                assert t["reads"] == {kind: 1}
        finally:
            if consumers is not None:
                consumers.close()
            victim.close()
    assert ended["mapped"] == ended["nixl"]
    assert ended["nixl"] == {rid: ("failed", "source_lost", "SourceLostError") for rid in ("mid", "after")}


def test_a_new_incarnation_invalidates_the_old_mapping_before_any_later_copy(cluster, secret_file):
    incarnation_case(cluster, secret_file, SPEC, "shm")


def incarnation_case(cluster, secret_file, spec, kind):
    pw, cw = cluster.workers[0], cluster.workers[1]
    ended = {}
    for transport in TRANSPORTS:
        p_cfg, c_cfg = _configs(secret_file, transport)
        engine_id = f"prefill-{uuid.uuid4().hex[:6]}"
        old, new = f"{engine_id}-old", f"{engine_id}-new"
        consumers = start_consumers([cw], [spec], c_cfg)
        ck = consumers.keys[0]
        try:
            address = pw.call("create_producer", old, spec, engine_id, 1, p_cfg)
            _linked(cw, ck, address)
            first = _hold(pw, old, spec, "first", MID, 5)
            cw.call("start_read", ck, first, LOCAL_MID, 20)
            assert cw.call("wait_done", ck, ["first"], WAIT_S)[0].state == "done"
            stale = _hold(pw, old, spec, "stale", AFTER, 6)
            pw.call("close", old)  # the engine restarts: a new incarnation under the same engine id
            pw.call("create_producer", new, spec, engine_id, 2, p_cfg)
            fresh = _hold(pw, new, spec, "fresh", MID, 7)
            cw.call("start_read", ck, fresh, LOCAL_MID, 20)
            assert cw.call("wait_done", ck, ["fresh"], WAIT_S)[0].state == "done"
            before = cw.call("call", blocks_digest, ck, LOCAL_AFTER)
            copies = cw.call("call", transports, ck)["copies"]
            cw.call("start_read", ck, stale, LOCAL_AFTER, 30)
            ended[transport] = _ended(cw.call("call", wait_results, ck, ["stale"], WAIT_S))
            t = cw.call("call", transports, ck)
            if transport == "mapped":
                assert cw.call("call", blocks_digest, ck, LOCAL_AFTER) == before
                assert t["copies"] == copies  # nothing copied from either mapping for "stale"
                assert list(t["mapped"].values()) == [kind]  # only the new incarnation's agent is mapped
        finally:
            consumers.close()
            for key in (old, new):
                pw.call("close", key)
    assert ended["mapped"] == ended["nixl"]
    assert ended["nixl"]["stale"][0] == "failed"


def _hold(worker, key, spec, request_id, layout, seed):
    from harness import EngineRanks

    ranks = EngineRanks([worker], [key], [spec])
    return hold_everywhere(ranks, request_id, layout, seed=seed)


def test_a_consumer_without_the_secret_never_gets_a_handle(cluster, secret_file):
    no_secret_case(cluster, secret_file, SPEC)


def no_secret_case(cluster, secret_file, spec):
    pw, cw = cluster.workers[0], cluster.workers[1]
    producers = start_producers([pw], [spec], EngineConfig(secret_file=secret_file))
    open_consumer = start_consumers([cw], [spec], EngineConfig(handshake_timeout_s=2.0))
    ck = open_consumer.keys[0]
    try:
        ticket = hold_everywhere(producers, "x", MID, seed=8)
        cw.call("start_read", ck, ticket, LOCAL_MID, 20)  # a signed ticket it cannot check: nothing connects
        ended = _ended(cw.call("call", wait_results, ck, ["x"], WAIT_S))
        assert ended == {"x": ("failed", "ticket_edited", "TicketClaimError")}
        with pytest.raises(RemoteError) as info:  # asked to connect anyway: refused before anything of the cache
            cw.call("connect", ck, producers.addresses[0], 10.0)
        assert info.value.type_name == "HandshakeError" and info.value.attrs["cause"] == "secret"
        t = cw.call("call", transports, ck)
        assert t["mapped"] == {} and t["reads"] == {} and t["copies"] == {}
        stats = pw.call("producer_status", producers.keys[0])
        assert stats["listener"]["accepted"] == 0 and stats["listener"]["rejected"] >= 1
    finally:
        producers.close()
        open_consumer.close()
