"""Fast reclaim (docs/lifecycle.md): a consumer that is gone gives its claimed blocks back long before the lease.

Real NIXL agents in separate processes (loopback DRAM). The producer runs on a ManualClock the test
moves (lifecycle_ops.py) with a lease of 600 s, so "before the lease" is a fact of the clock, not of
wall time: the test advances the clock by one probe interval per round, in a bounded number of rounds.
A consumer is made to look busy by pausing its polling after its READs and claims went out (the producer
is paused meanwhile, so no READ is DONE before that): it then checks and reports nothing, as one that is
slow (or dead) would.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from api_ops import fill, hold_ticket_and_poll, rank_card
from harness import TINY, EngineRanks, RankSpec, Worker, hold_everywhere, worker_context
from lifecycle_ops import advance_clock, create_producer, pause, resume, status, wait_results

from hybrid_transfer.engine import EngineCard, EngineConfig, encode_ticket, issue_ticket
from hybrid_transfer.verify import RequestLayout

WAIT_S = 30.0
LEASE_S = 600.0
PROBE_S = 1.0
MAX_ROUNDS = 20  # probe intervals the producer's clock may move before the blocks must be back
SPEC = RankSpec(TINY, 1, 0, 32)
C_CONFIG = EngineConfig(read_deadline_s=600.0, lease_s=LEASE_S)


def _layout(i: int) -> RequestLayout:
    b = 5 * i
    return RequestLayout(((b, b + 1), (b + 2,), (b + 3,), (b + 4,)), 20)


def _local(i: int) -> tuple[tuple[int, ...], ...]:
    return _layout(i).block_ids


@pytest.fixture
def victim():
    """A fresh worker of its own: the kill tests kill it."""
    w = Worker(worker_context(), 200)
    yield w
    w.close()


def _until(what: str, check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


def _producer(worker: Worker, probe_s: float) -> EngineRanks:
    engine_id, incarnation = f"prefill-{uuid.uuid4().hex[:6]}", int.from_bytes(os.urandom(6), "little")
    key = f"{engine_id}-0"
    config = EngineConfig(lease_s=LEASE_S, peer_probe_s=probe_s)
    address = worker.call("call", create_producer, key, SPEC, engine_id, incarnation, config, True)
    return EngineRanks([worker], [key], [SPEC], [address], engine_id, incarnation)


def _consumer(worker: Worker, engine_id: str) -> str:
    key = f"{engine_id}-0-{uuid.uuid4().hex[:4]}"
    worker.call("create_consumer", key, SPEC, C_CONFIG, engine_id)
    return key


def _welcomed_consumer(worker: Worker, producers: EngineRanks) -> str:
    """A consumer on ``worker`` (a fresh engine id), connected to the producer and welcomed; its key."""
    ck = _consumer(worker, f"decode-{uuid.uuid4().hex[:6]}")
    worker.call("connect", ck, producers.addresses[0], 10.0)
    _until("the welcome", lambda: worker.call("call", status, ck)["stats"]["welcomes"] == 1)
    return ck


def _claimed_reads(producers: EngineRanks, c_worker: Worker, ck: str, n: int, welcomes: int = 1) -> list[str]:
    """Link the consumer, read ``n`` requests, pause it once the producer confirmed every claim."""
    p_worker, pk = producers.workers[0], producers.keys[0]
    c_worker.call("connect", ck, producers.addresses[0], 10.0)
    _until("the welcome", lambda: c_worker.call("call", status, ck)["stats"]["welcomes"] == welcomes)
    rids = [f"r{i}-{uuid.uuid4().hex[:4]}" for i in range(n)]
    tickets = [hold_everywhere(producers, rid, _layout(i), seed=10 + i) for i, rid in enumerate(rids)]
    p_worker.call("call", pause, pk)  # READs stay in PROC while the producer is not progressed
    for i, ticket in enumerate(tickets):
        c_worker.call("start_read", ck, ticket, _local(i), 20)
    c_worker.call("call", pause, ck)  # ... and the consumer will not look at them again
    p_worker.call("call", resume, pk)
    _until("the claims", lambda: p_worker.call("call", status, pk)["stats"]["claims_confirmed"] == n)
    st = p_worker.call("call", status, pk, rids)
    assert set(st["holds"].values()) == {"held"} and st["pinned_blocks"] == 5 * n
    return rids


def _rounds_until_released(p_worker: Worker, pk: str, rids: list[str]) -> int:
    """Move the producer's clock one probe interval per round; the round in which every hold was released."""
    for rounds in range(1, MAX_ROUNDS + 1):
        now = p_worker.call("call", advance_clock, pk, PROBE_S)
        assert now < LEASE_S
        p_worker.call("settle", 0.05)
        st = p_worker.call("call", status, pk, rids)
        if st["held_requests"] == 0 and st["pinned_blocks"] == 0:
            return rounds
    raise AssertionError(f"blocks still pinned after {MAX_ROUNDS} probe intervals: {st}")


def test_row6_a_consumer_killed_with_four_reads_in_flight_gives_its_blocks_back_long_before_the_lease(
        cluster, victim):
    p_worker = cluster.workers[0]
    producers = _producer(p_worker, PROBE_S)
    pk = producers.keys[0]
    try:
        ck = _consumer(victim, f"decode-{uuid.uuid4().hex[:6]}")
        rids = _claimed_reads(producers, victim, ck, 4)
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.join(timeout=30)
        assert victim.process.exitcode == -signal.SIGKILL
        rounds = _rounds_until_released(p_worker, pk, rids)
        print(f"row 6: 4 claimed holds released after {rounds} probe interval(s) of {PROBE_S} s "
              f"(lease {LEASE_S} s)")
        st = p_worker.call("call", status, pk, rids)
        assert st["terminal"] == {"aborted": 4}
        assert st["stats"]["reclaims"] == 4 and st["stats"]["peers_lost"] == 1
        assert st["stats"]["completions"] == 0  # nobody reported: the release came from the reclaim
        assert sorted(p_worker.call("wait_freed", pk, rids, WAIT_S)) == sorted(rids)
    finally:
        producers.close()


def _kill(victim: Worker) -> None:
    os.kill(victim.process.pid, signal.SIGKILL)
    victim.process.join(timeout=30)
    assert victim.process.exitcode == -signal.SIGKILL


def _rounds_after_loss(p_worker: Worker, pk: str, rids: list[str]) -> tuple[int, int]:
    """Move the producer's clock one probe interval per round (round 0: before any move); the first round in
    which NIXL had reported the agent disconnected, and the first in which every hold of ``rids`` was released."""
    lost = None
    for rounds in range(MAX_ROUNDS + 1):
        if rounds:
            assert p_worker.call("call", advance_clock, pk, PROBE_S) < LEASE_S
        p_worker.call("settle", 0.05)
        st = p_worker.call("call", status, pk, rids)
        if lost is None and st["stats"]["peers_lost"]:
            lost = rounds
        if lost is not None and set(st["holds"].values()) == {None} and st["pinned_blocks"] == 0:
            return lost, rounds
    raise AssertionError(f"blocks still pinned after {MAX_ROUNDS} probe intervals (agent lost in round {lost}): {st}")


def test_row6_a_consumer_killed_with_four_claims_still_queued_gives_every_hold_back(cluster, victim):
    """Issue 19, row 6: the claims wait at a producer that is not polled when the consumer dies, so the first
    answer (or probe) finds it gone while the other claims are still to be taken in. Each of them revokes
    its hold too: all four within two probe intervals of NIXL reporting the agent disconnected."""
    p_worker = cluster.workers[0]
    producers = _producer(p_worker, PROBE_S)
    pk = producers.keys[0]
    try:
        ck = _welcomed_consumer(victim, producers)
        rids = [f"q{i}-{uuid.uuid4().hex[:4]}" for i in range(4)]
        tickets = [hold_everywhere(producers, rid, _layout(i), seed=40 + i) for i, rid in enumerate(rids)]
        p_worker.call("call", pause, pk)  # the claims queue up in its NIXL agent
        for i, ticket in enumerate(tickets):
            victim.call("start_read", ck, ticket, _local(i), 20)
        victim.call("settle", 0.2)  # its claims are on the wire; no answer can come while the producer is paused
        _kill(victim)
        p_worker.call("call", resume, pk)
        lost, released = _rounds_after_loss(p_worker, pk, rids)
        print(f"row 6 (queued claims): agent reported gone in round {lost}, 4 holds released in round {released} "
              f"(probe {PROBE_S} s, lease {LEASE_S} s)")
        assert released - lost <= 2
        st = p_worker.call("call", status, pk, rids)
        assert st["terminal"] == {"aborted": 4} and st["stats"]["reclaims"] == 4 and st["stats"]["peers_lost"] == 1
        assert st["stats"]["completions"] == 0
        assert sorted(p_worker.call("wait_freed", pk, rids, WAIT_S)) == sorted(rids)
    finally:
        producers.close()


def test_row6_claims_kept_before_their_hold_are_revoked_at_the_hold_once_the_agent_is_gone(cluster, victim):
    """A scheduler issued the tickets and the consumer read before the producer rank held (its claims are kept,
    lifecycle/early.py). It dies; the first hold finds that out, and every later hold whose kept claim came
    from it is revoked at once instead of being confirmed to an agent nobody probes."""
    p_worker = cluster.workers[0]
    producers = _producer(p_worker, PROBE_S)
    pk = producers.keys[0]
    try:
        ck = _welcomed_consumer(victim, producers)
        card = EngineCard.from_ranks([p_worker.call("call", rank_card, pk)])
        rids = [f"k{i}-{uuid.uuid4().hex[:4]}" for i in range(4)]
        tickets = [issue_ticket(card, rid, _layout(i).block_ids, 20) for i, rid in enumerate(rids)]
        for i, ticket in enumerate(tickets):
            p_worker.call("call", fill, pk, _layout(i), 50 + i)
            victim.call("start_read", ck, encode_ticket(ticket), _local(i), 20)
        _until("the kept claims", lambda: p_worker.call("call", status, pk)["stats"]["claims_kept"] == 4)
        _kill(victim)
        p_worker.call("call", hold_ticket_and_poll, pk, encode_ticket(tickets[0]))
        lost, first = _rounds_after_loss(p_worker, pk, rids[:1])  # its answer or a probe finds the agent gone
        assert first - lost <= 2
        for ticket in tickets[1:]:
            p_worker.call("call", hold_ticket_and_poll, pk, encode_ticket(ticket))
        _, released = _rounds_after_loss(p_worker, pk, rids)
        print(f"row 6 (claims kept before their holds): first hold back {first - lost} round(s) after the loss, the "
              f"other three in round {released} after their holds (probe {PROBE_S} s, lease {LEASE_S} s)")
        assert released <= 2, released
        st = p_worker.call("call", status, pk, rids)
        assert st["terminal"] == {"aborted": 4} and st["stats"]["reclaims"] == 4 and st["stats"]["peers_lost"] == 1
        assert st["stats"]["completions"] == 0 and st["stats"]["claims_from_gone"] == 3
    finally:
        producers.close()


def test_with_probes_off_a_killed_consumers_blocks_wait_for_the_lease(cluster, victim):
    """The behaviour before fast reclaim, and still the last resort: nothing is released until the lease."""
    p_worker = cluster.workers[0]
    producers = _producer(p_worker, 0.0)
    pk = producers.keys[0]
    try:
        ck = _consumer(victim, f"decode-{uuid.uuid4().hex[:6]}")
        rids = _claimed_reads(producers, victim, ck, 4)
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.join(timeout=30)
        for _ in range(MAX_ROUNDS):
            p_worker.call("call", advance_clock, pk, PROBE_S)
            p_worker.call("settle", 0.02)
        st = p_worker.call("call", status, pk, rids)
        assert set(st["holds"].values()) == {"held"} and st["pinned_blocks"] == 20
        assert st["stats"]["probes_sent"] == 0 and st["stats"]["reclaims"] == 0
        p_worker.call("call", advance_clock, pk, LEASE_S)
        assert sorted(p_worker.call("wait_freed", pk, rids, WAIT_S)) == sorted(rids)
        assert p_worker.call("call", status, pk)["terminal"] == {"expired": 4}
    finally:
        producers.close()


def test_a_slow_consumer_keeps_its_lease_and_finishes(cluster):
    p_worker, c_worker = cluster.workers[0], cluster.workers[1]
    producers = _producer(p_worker, PROBE_S)
    pk = producers.keys[0]
    ck = _consumer(c_worker, f"decode-{uuid.uuid4().hex[:6]}")
    paused = True
    try:
        rids = _claimed_reads(producers, c_worker, ck, 2)
        for _ in range(MAX_ROUNDS):  # many probes while it reports nothing
            p_worker.call("call", advance_clock, pk, PROBE_S)
            p_worker.call("settle", 0.02)
        st = p_worker.call("call", status, pk, rids)
        assert set(st["holds"].values()) == {"held"} and st["pinned_blocks"] == 10
        assert st["stats"]["probes_sent"] >= MAX_ROUNDS // 2 and st["stats"]["peers_lost"] == 0
        assert st["stats"]["reclaims"] == 0
        c_worker.call("call", resume, ck)
        paused = False
        results = c_worker.call("call", wait_results, ck, rids, WAIT_S)
        assert {r["state"] for r in results.values()} == {"done"}, results
        c_worker.call("check", ck, [(RequestLayout(_local(i), 20), 10 + i) for i in range(2)])
        assert sorted(p_worker.call("wait_freed", pk, rids, WAIT_S)) == sorted(rids)
        assert p_worker.call("call", status, pk)["terminal"] == {"freed": 2}
    finally:
        if paused:
            c_worker.call("call", resume, ck)
        c_worker.call("close", ck)
        producers.close()


def test_a_new_incarnation_revokes_what_the_old_one_claimed_and_frees_after_its_ack(cluster):
    """Probes off: only the new agent's Hello can tell. The old agent is alive (paused), so the blocks
    must wait for its acknowledgement: the path never frees under a reader that could still report DONE."""
    p_worker, old_worker, new_worker = cluster.workers[0], cluster.workers[1], cluster.workers[2]
    producers = _producer(p_worker, 0.0)
    pk = producers.keys[0]
    engine_id = f"decode-{uuid.uuid4().hex[:6]}"
    old = _consumer(old_worker, engine_id)
    new = None
    paused = True
    try:
        rids = _claimed_reads(producers, old_worker, old, 2)
        new = _consumer(new_worker, engine_id)  # the same engine and rank, another agent
        new_worker.call("connect", new, producers.addresses[0], 10.0)
        _until("the new agent's welcome", lambda: new_worker.call("call", status, new)["stats"]["welcomes"] == 1)
        st = _until("the reclaim", lambda: (s := p_worker.call("call", status, pk, rids))["stats"]["reclaims"] == 2
                    and s)
        assert st["stats"]["incarnations_replaced"] == 1 and st["stats"]["peers_lost"] == 0
        new_worker.call("settle", 0.1)
        p_worker.call("settle", 0.1)
        st = p_worker.call("call", status, pk, rids)
        assert set(st["holds"].values()) == {"aborting"} and st["pinned_blocks"] == 10  # the old one has not acked
        old_worker.call("call", resume, old)
        paused = False
        results = old_worker.call("call", wait_results, old, rids, WAIT_S)
        assert all(r is not None for r in results.values()), results
        for i, rid in enumerate(rids):  # either it finished before it read the Revoke (bytes intact) or it failed
            r = results[rid]
            assert (r["state"], r["cause"]) in {("done", None), ("failed", "revoked")}, r
            if r["state"] == "done":
                old_worker.call("check", old, [(RequestLayout(_local(i), 20), 10 + i)])
        assert sorted(p_worker.call("wait_freed", pk, rids, WAIT_S)) == sorted(rids)
        st = p_worker.call("call", status, pk)
        assert st["terminal"] == {"aborted": 2} and st["pinned_blocks"] == 0
    finally:
        if paused:
            old_worker.call("call", resume, old)
        old_worker.call("close", old)
        if new is not None:
            new_worker.call("close", new)
        producers.close()


# ---- bookkeeping, no NIXL ----------------------------------------------------------------
def test_consumer_slot_is_the_engine_rank_of_an_agent_name():
    from hybrid_transfer.engine.peer_record import consumer_agent_name, consumer_slot

    name = consumer_agent_name("decode-a-c1", 3, "ab12")
    assert consumer_slot(name, 3) == "decode-a-c1-c3"
    assert consumer_slot(consumer_agent_name("decode-a-c1", 3, "ff00"), 3) == consumer_slot(name, 3)
    assert consumer_slot(name, 2) is None  # another rank than the name says
    assert consumer_slot("stranger", 0) is None and consumer_slot("-c0-x", 0) is None


def test_the_book_watches_unreported_claims_and_unacknowledged_revocations():
    from hybrid_transfer.engine.lifecycle.holds import HoldBook
    from hybrid_transfer.engine.lifecycle.state import HoldState

    book = HoldBook(lambda: 0.0, 60.0)
    a = book.add("a", 1, ((0,), (1,)), 4)
    b = book.add("b", 2, ((2,), (3,)), 4)
    a.claimed = {0: "x", 1: "y"}
    b.claimed = {0: "x"}
    book.report(a, 0, 2, "x")  # x reported a, not b
    assert [h.request_id for h in book.claimed_by("x")] == ["b"]
    assert [h.request_id for h in book.claimed_by("y")] == ["a"]
    assert book.watched_agents() == {"x", "y"}
    book.abort(b, {"z"})
    assert b.state is HoldState.ABORTING and book.claimed_by("x") == []
    assert book.watched_agents() == {"y", "z"}


@pytest.mark.parametrize("bad", [-1.0, float("inf"), float("nan"), True, "1"])
def test_peer_probe_s_is_checked(bad):
    from hybrid_transfer.errors import ConfigError

    with pytest.raises(ConfigError, match="peer_probe_s"):
        EngineConfig(peer_probe_s=bad).validate()
    assert EngineConfig(peer_probe_s=0).validate().peer_probe_s == 0
