"""Scheduler-issued tickets, early completions and declines, through real NIXL agents on separate processes.

The test process plays a serving engine's scheduler: it gathers the producer ranks' cards,
issues tickets without any NIXL, and hands them to the ranks and the consumers.
"""

from __future__ import annotations

import time
import uuid

import pytest
from api_ops import decline, decline_counts, expect, fill, hold_ticket_and_poll, rank_card
from harness import TINY, RankSpec, RemoteError, hold_everywhere, start_consumers, start_producers

from hybrid_transfer.engine import EngineCard, EngineConfig, encode_ticket, issue_ticket, wire
from hybrid_transfer.verify import RequestLayout

WAIT_S = 60.0
LAYOUT = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)  # tiny model, block 16: 20 tokens in two blocks
LOCAL = RequestLayout(((5, 6), (7,), (8,), (9,)), 20)


def _status(worker, key, request_ids=()):
    return worker.call("producer_status", key, list(request_ids))


def _wait_producer(worker, key, **expected) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = _status(worker, key)["stats"]
        if all(stats[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            assert {k: stats[k] for k in expected} == expected
            return stats
        worker.call("settle", 0.02)


def _bare_producers(workers, tp, num_blocks=16, config=None):
    """Producer ranks that were never told each other's addresses: only the tickets will tell them."""
    engine_id, incarnation = f"prefill-{uuid.uuid4().hex[:6]}", (1 << 62) + 12345
    keys = [f"{engine_id}-{r}" for r in range(tp)]
    for r, (w, k) in enumerate(zip(workers, keys, strict=True)):
        w.call("create_producer", k, RankSpec(TINY, tp, r, num_blocks), engine_id, incarnation, config)
    return keys


def _close(workers, keys):
    for w, k in zip(workers, keys, strict=True):
        w.call("close", k)


def test_ranks_hold_the_tickets_their_scheduler_issued_and_refuse_mismatches(cluster):
    p_workers, c_worker = cluster.workers[:2], cluster.workers[2]
    keys = _bare_producers(p_workers, 2)
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 16)])
    try:
        card = EngineCard.from_ranks({r: w.call("call", rank_card, k)
                                      for r, (w, k) in enumerate(zip(p_workers, keys, strict=True))})
        assert all(a.startswith("tcp://127.0.0.1:") for a in card.addresses)  # port 0: each rank's bound port
        good = issue_ticket(card, "sched", LAYOUT.block_ids, LAYOUT.num_tokens)
        stranger = card.__class__(**{**_fields(card), "incarnation": card.incarnation + 1, "engine_id": "x"})
        cases = [  # (ticket, the rank's own block ids or None, the differences named)
            (issue_ticket(stranger, "sched", LAYOUT.block_ids, LAYOUT.num_tokens, nonce=good.nonce), None,
             ["engine_id", "incarnation"]),
            (wire.Ticket(**{**_fields(good), "tp_size": 4, "addresses": good.addresses * 2}), None,
             ["tp_size", "addresses"]),
            (good, ((0, 1), (2,), (3,), (5,)), ["block_ids"]),
        ]
        for ticket, own_ids, fields in cases:
            with pytest.raises(RemoteError) as info:
                p_workers[1].call("call", hold_ticket_and_poll, keys[1], encode_ticket(ticket), own_ids)
            assert info.value.type_name == "TicketMismatchError"
            assert [d[0] for d in info.value.attrs["differences"]] == fields
            assert _status(p_workers[1], keys[1])["num_held_blocks"] == 0
        # Block ids the rank's cache cannot hold are refused by the rank too, before pinning.
        with pytest.raises(RemoteError) as info:
            p_workers[1].call("call", hold_ticket_and_poll, keys[1],
                              encode_ticket(wire.Ticket(**{**_fields(good), "block_ids": ((0, 99), (2,), (3,), (4,))})))
        assert info.value.type_name == "BlockIdError"
        assert _status(p_workers[1], keys[1])["num_held_blocks"] == 0
        for w, k in zip(p_workers, keys, strict=True):
            w.call("call", fill, k, LAYOUT, 11)
            assert w.call("call", hold_ticket_and_poll, k, encode_ticket(good)) == []
        c_worker.call("start_read", consumers.keys[0], encode_ticket(good), LOCAL.block_ids, LOCAL.num_tokens)
        assert c_worker.call("wait_done", consumers.keys[0], ["sched"], WAIT_S)[0].state == "done"
        for w, k in zip(p_workers, keys, strict=True):
            assert w.call("wait_freed", k, ["sched"], WAIT_S) == ["sched"]
        c_worker.call("check", consumers.keys[0], [(LOCAL, 11)])
    finally:
        _close(p_workers, keys)
        consumers.close()


def _fields(struct) -> dict:
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


@pytest.mark.parametrize("announce", [False, True], ids=["grace", "expect"])
def test_a_read_before_the_hold_is_confirmed_at_the_hold(cluster, announce):
    """A read may start before the producer rank holds (the scheduler keeps the blocks), but it is DONE only
    once the hold confirmed its claim (engine/claims.py): the claim is kept like an early completion."""
    p_worker, c_worker = cluster.workers[0], cluster.workers[1]
    keys = _bare_producers([p_worker], 1)
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 16)])
    try:
        card = EngineCard.from_ranks([p_worker.call("call", rank_card, keys[0])])
        ticket = issue_ticket(card, "early", LAYOUT.block_ids, LAYOUT.num_tokens)
        if announce:
            p_worker.call("call", expect, keys[0], "early", ticket.nonce)
        p_worker.call("call", fill, keys[0], LAYOUT, 21)
        # The consumer reads before the producer rank holds: the scheduler still keeps those blocks.
        c_worker.call("start_read", consumers.keys[0], encode_ticket(ticket), LOCAL.block_ids, LOCAL.num_tokens)
        _wait_producer(p_worker, keys[0], claims_kept=1)
        assert c_worker.call("wait_done", consumers.keys[0], ["early"], 0.5)[0].state == "timeout"
        assert _status(p_worker, keys[0])["num_held_requests"] == 0
        # The hold takes the claim in and confirms it: DONE, then the completion frees the request.
        p_worker.call("call", hold_ticket_and_poll, keys[0], encode_ticket(ticket))
        assert c_worker.call("wait_done", consumers.keys[0], ["early"], WAIT_S)[0].state == "done"
        assert p_worker.call("wait_freed", keys[0], ["early"], WAIT_S) == ["early"]
        status = _status(p_worker, keys[0], ["early"])
        assert status["held"] == [] and status["num_held_blocks"] == 0
        assert status["stats"]["early_replayed"] == 1 and status["stats"]["completions"] == 1
        assert status["stats"]["claims_confirmed"] == 1 and status["stats"]["early_lapsed"] == 0
        c_worker.call("check", consumers.keys[0], [(LOCAL, 21)])
    finally:
        _close([p_worker], keys)
        consumers.close()


def test_every_consumer_rank_declines_and_the_producer_frees_at_once(cluster):
    """1 -> 2 fan-out, consumers that never handshaked: the declines connect first, then tell the producer."""
    p_worker, c_workers = cluster.workers[0], cluster.workers[1:3]
    config = EngineConfig(lease_s=600.0)  # the lease can never be what frees it here
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)], config)
    consumers = start_consumers(c_workers, [RankSpec(TINY, 2, r, 16) for r in range(2)])
    try:
        ticket = hold_everywhere(producers, "declined", LAYOUT, seed=None)
        pk = producers.keys[0]
        assert c_workers[0].call("call", decline, consumers.keys[0], ticket) is True
        assert c_workers[0].call("call", decline, consumers.keys[0], ticket) is False  # once is enough
        _wait_producer(p_worker, pk, completions_aborted=1)
        assert _status(p_worker, pk, ["declined"])["held"] == ["declined"]  # rank 1 has not declined yet
        assert c_workers[1].call("call", decline, consumers.keys[1], ticket) is True
        assert p_worker.call("wait_freed", pk, ["declined"], WAIT_S) == ["declined"]
        status = _status(p_worker, pk)
        assert status["num_held_blocks"] == 0 and status["stats"]["completions_aborted"] == 2
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            c_status = w.call("consumer_status", k)
            assert c_status["num_active"] == 0
            assert (c_status["stats"]["declines_sent"], c_status["stats"]["declines_dropped"]) == (1, 0)
            assert c_status["stats"]["reads_posted"] == 0
    finally:
        producers.close()
        consumers.close()


def test_a_decline_before_the_hold_frees_the_request_at_the_hold(cluster):
    p_worker, c_worker = cluster.workers[0], cluster.workers[1]
    keys = _bare_producers([p_worker], 1, config=EngineConfig(lease_s=600.0))
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 16)])
    try:
        card = EngineCard.from_ranks([p_worker.call("call", rank_card, keys[0])])
        ticket = issue_ticket(card, "unread", LAYOUT.block_ids, LAYOUT.num_tokens)
        assert c_worker.call("call", decline, consumers.keys[0], encode_ticket(ticket)) is True
        _wait_producer(p_worker, keys[0], early_kept=1)
        assert p_worker.call("call", hold_ticket_and_poll, keys[0], encode_ticket(ticket)) == ["unread"]
        status = _status(p_worker, keys[0])
        assert status["num_held_blocks"] == 0 and status["stats"]["completions_aborted"] == 1
    finally:
        _close([p_worker], keys)
        consumers.close()


def test_a_decline_towards_an_unreachable_engine_is_dropped_after_the_handshake_timeout(cluster):
    """Nothing listens at the ticket's address: decline() still returns at once, poll() gives up later."""
    import socket

    with socket.socket() as s:  # a port that was free a moment ago and that nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    c_worker = cluster.workers[1]
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 16)], EngineConfig(handshake_timeout_s=0.5))
    try:
        ticket = wire.Ticket(engine_id="ghost", incarnation=1, addresses=(address,), tp_size=1, request_id="lost",
                             nonce=5, block_ids=LAYOUT.block_ids, num_tokens=20, state_position=20, lease_s=120.0)
        key = consumers.keys[0]
        assert c_worker.call("call", decline, key, encode_ticket(ticket)) is True
        assert c_worker.call("call", decline_counts, key)["pending"] == 1
        deadline = time.monotonic() + WAIT_S
        while c_worker.call("call", decline_counts, key)["pending"] and time.monotonic() < deadline:
            c_worker.call("settle", 0.1)
        assert c_worker.call("call", decline_counts, key) == {"pending": 0, "sent": 0, "dropped": 1}
    finally:
        consumers.close()


def test_declining_a_request_being_read_is_refused(cluster):
    p_worker, c_worker = cluster.workers[0], cluster.workers[1]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)])
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 16)])
    try:
        ticket = hold_everywhere(producers, "busy", LAYOUT, seed=3)
        p_worker.call("call", _pause, producers.keys[0])  # keeps the read from finishing before the decline
        c_worker.call("start_read", consumers.keys[0], ticket, LOCAL.block_ids, LOCAL.num_tokens)
        with pytest.raises(RemoteError) as info:
            c_worker.call("call", decline, consumers.keys[0], ticket)
        assert info.value.type_name == "RequestStateError"
        p_worker.call("call", _resume, producers.keys[0])
        assert c_worker.call("wait_done", consumers.keys[0], ["busy"], WAIT_S)[0].state == "done"
    finally:
        producers.close()
        consumers.close()


def _pause(state, key):
    from lifecycle_ops import pause

    pause(state, key)


def _resume(state, key):
    from lifecycle_ops import resume

    resume(state, key)
