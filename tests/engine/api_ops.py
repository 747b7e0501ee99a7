"""Worker-side helpers for the scheduler-issued ticket tests, run through harness ``call``.

A module of their own so spawned workers can import them by name; each takes the worker's state first.
"""

from __future__ import annotations


def rank_card(state, key):
    return state.ranks[key].engine.rank_card


def fill(state, key, layout, seed) -> None:
    """Write a request's pattern into a producer rank's blocks without holding it (the scheduler still owns them)."""
    from hybrid_transfer.verify import fill_source

    fill_source(state.ranks[key].engine.cache, layout, seed)


def hold_ticket_and_poll(state, key, ticket_bytes, block_ids=None) -> list[str]:
    """Hold with a scheduler's ticket (and the rank's own block ids, if given), then poll once: the
    request ids released by that one poll."""
    from hybrid_transfer.engine import decode_ticket

    rank = state.ranks[key]
    ticket = decode_ticket(ticket_bytes)
    held = rank.engine.hold(ticket.request_id, block_ids, ticket=ticket)
    assert held == ticket
    released = rank.engine.poll()
    rank.freed.update(released)
    return released


def decline(state, key, ticket_bytes) -> bool:
    from hybrid_transfer.engine import decode_ticket

    return state.ranks[key].engine.decline(decode_ticket(ticket_bytes))


def expect(state, key, request_id, nonce) -> None:
    state.ranks[key].engine.expect(request_id, nonce)


def decline_counts(state, key) -> dict:
    consumer = state.ranks[key].engine
    return {"pending": consumer.num_pending_declines, "sent": consumer.stats.declines_sent,
            "dropped": consumer.stats.declines_dropped}
