"""HoldBook: a producer's holds on an injected clock, checked against invariants over random histories."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.engine.lifecycle.holds import Heard, HoldBook
from hybrid_transfer.engine.lifecycle.state import HoldState
from hybrid_transfer.errors import FenceError, RequestStateError


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _book(lease_s=10.0):
    clock = Clock()
    return HoldBook(clock, lease_s), clock


def test_shared_blocks_are_pinned_per_hold_and_released_with_the_last():
    book, _ = _book()
    a = book.add("a", 1, ((1, 2), (3,)), 20)
    b = book.add("b", 2, ((1,), (4,)), 5)
    assert book.num_pinned_blocks == 4 and book.num_held_requests == 2
    with pytest.raises(RequestStateError):
        book.add("a", 3, ((5,), (6,)), 1)
    assert book.report(a, 0, 1, "c0") is Heard.ENDED and book.pop_released() == ["a"]
    assert book.num_pinned_blocks == 2  # block 1 is still b's
    assert book.report(b, 0, 2, "c0") is Heard.COUNTED
    assert book.report(b, 0, 2, "c0") is Heard.DUPLICATE
    assert book.report(b, 1, 3, "c1") is Heard.INCONSISTENT
    assert book.report(b, 1, 2, "c1") is Heard.ENDED
    assert book.pop_released() == ["b"] and book.num_pinned_blocks == 0
    assert book.terminal_counts == {"freed": 2}


def test_fences_refuse_a_hold_and_delay_a_release():
    book, _ = _book()
    book.fences.mark([3], 1)
    with pytest.raises(FenceError):
        book.add("a", 1, ((1, 2), (3,)), 20)
    book.fences.finish(1)
    hold = book.add("a", 1, ((1, 2), (3,)), 20)
    book.fences.mark([2], 4)
    book.report(hold, 0, 1, "c0")
    assert book.pop_released() == [] and book.num_pinned_blocks == 3 and book.num_releasing == 1
    book.fences.finish(4)
    assert book.pop_released() == ["a"] and book.num_pinned_blocks == 0


def test_leases_expire_revoke_and_lapse():
    book, clock = _book(lease_s=10.0)
    hold = book.add("a", 1, ((1,), (2,)), 1)
    clock.now = 6.0
    book.renew(hold)
    clock.now = 15.9
    assert book.expire() == []
    clock.now = 16.0
    assert [h.state for h in book.expire()] == [HoldState.EXPIRED] and book.revocations() == [("a", 1)]
    clock.now = 26.0  # one lease after the revocation: no live ticket can match it any more
    assert book.revocations() == [] and book.pop_released() == ["a"]


def test_aborts_end_at_once_without_readers_else_after_every_ack_or_the_lease():
    book, clock = _book()
    lone = book.add("lone", 1, ((1,), (2,)), 1)
    assert book.abort(lone, []) and book.pop_released() == ["lone"]
    read = book.add("read", 2, ((3,), (4,)), 1)
    assert not book.abort(read, {"c0", "c1"}) and read.state is HoldState.ABORTING
    with pytest.raises(RequestStateError):
        book.abort(read, {"c0"})
    assert book.ack("read", 99, "c0") is Heard.STALE and book.ack("read", 2, "c9") is Heard.STALE
    assert book.ack("read", 2, "c0") is Heard.COUNTED
    assert [h.request_id for h in book.forget_agent("c1")] == ["read"] and read.state is HoldState.ABORTED
    slow = book.add("slow", 3, ((5,), (6,)), 1)
    book.abort(slow, {"c0"})
    assert sorted(book.revocations()) == [("lone", 1), ("read", 2), ("slow", 3)]
    clock.now = 10.0  # slow's lease ends unacknowledged; every revocation lapses with it
    assert [h.state for h in book.expire()] == [HoldState.ABORTED] and book.revocations() == []
    assert book.terminal_counts == {"aborted": 3}


OPS = st.lists(st.tuples(st.sampled_from(["add", "claim", "report", "abort", "ack", "renew", "tick", "mark", "finish"]),
                         st.integers(0, 4), st.integers(0, 2)), max_size=80)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_every_hold_ends_once_and_pins_exactly_what_is_not_released(ops):
    book, clock = _book(lease_s=3.0)
    blocks = {i: ((2 * i,), (2 * i + 1,)) for i in range(5)}
    added, released, step = 0, [], 0
    for op, i, x in ops:
        rid, hold = f"r{i}", book.get(f"r{i}")
        if op == "add" and hold is None:
            try:
                book.add(rid, i, blocks[i], 1)
                added += 1
            except FenceError:
                pass
        elif hold is not None and op == "claim" and x not in hold.claimed and x not in hold.heard:
            hold.claimed[x] = f"c{x}"  # what Producer._on_claim records for a confirmed claim
        elif hold is not None and op == "report":
            reader = hold.claimed.get(x)
            heard = book.report(hold, x, 2, f"c{i % 3}")
            if reader is not None and f"c{i % 3}" != reader:
                assert heard is Heard.NOT_READER and hold.state is not HoldState.FREED
        elif hold is not None and op == "abort" and hold.state is HoldState.HELD:
            book.abort(hold, {f"c{k}" for k in range(x)})
        elif op == "ack":
            book.ack(rid, i, f"c{x}")
        elif hold is not None and op == "renew":
            book.renew(hold)
        elif op == "tick":
            clock.now += x
            book.expire()
        elif op == "mark":
            step += 1
            book.fences.mark(blocks[i][0], step)
        elif op == "finish":
            book.fences.finish(step)
        released += book.pop_released()
        ended = sum(book.terminal_counts.values())
        assert ended + book.num_held_requests == added  # every hold is live or ended, once
        assert ended - len(released) == book.num_releasing  # every ended hold is released once
        holders = list(book.held_ids()) + [h.request_id for h in book._releasing]
        assert book.num_pinned_blocks == len({b for r in holders for g in blocks[int(r[1:])] for b in g})
    book.fences.finish(step)
    released += book.pop_released()
    assert book.num_releasing == 0 and len(released) == sum(book.terminal_counts.values())


def test_a_report_counts_only_from_the_agent_whose_claim_for_its_rank_was_confirmed():
    """docs/lifecycle.md#who-reports: another agent's DONE, abort or decline of a claimed rank is ignored."""
    book, _ = _book()
    hold = book.add("a", 1, ((1, 2), (3,)), 20)
    hold.claimed[0] = "reader"
    assert book.report(hold, 0, 1, "second") is Heard.NOT_READER
    assert hold.state is HoldState.HELD and hold.heard == {} and book.pop_released() == []
    assert book.report(hold, 0, 1, "reader") is Heard.ENDED
    assert book.pop_released() == ["a"] and book.terminal_counts == {"freed": 1}


def test_before_any_claim_the_first_report_speaks_for_a_rank():
    """A decline, or a DONE of a rank that read nothing here (zero tokens, a fan-in source it only notifies)."""
    book, _ = _book()
    hold = book.add("a", 1, ((1, 2), (3,)), 20)
    assert book.report(hold, 0, 2, "anyone") is Heard.COUNTED
    assert book.report(hold, 0, 2, "other") is Heard.DUPLICATE
    hold.claimed[1] = "reader"
    assert book.report(hold, 1, 2, "other") is Heard.NOT_READER
    assert book.report(hold, 1, 2, "reader") is Heard.ENDED and hold.state is HoldState.FREED


def test_held_blocks_are_capped_and_a_refused_hold_pins_nothing():
    from hybrid_transfer.errors import HoldCapacityError

    clock = Clock()
    book = HoldBook(clock, 10.0, max_pinned_blocks=5)
    a = book.add("a", 1, ((1, 2), (3,)), 20)
    with pytest.raises(HoldCapacityError) as info:
        book.add("b", 2, ((4, 5), (6,)), 20)
    assert (info.value.held, info.value.asked, info.value.cap) == (3, 3, 5) and "max_held_blocks=5" in str(info.value)
    assert book.get("b") is None and book.num_pinned_blocks == 3 and book.num_held_requests == 1
    book.add("c", 3, ((1, 2), (4,)), 20)  # shares two of a's blocks: one more pinned
    book.add("d", 4, ((5,), (3,)), 20)
    assert book.num_pinned_blocks == 5
    book.report(a, 0, 1, "c0")
    assert book.pop_released() == ["a"] and book.num_pinned_blocks == 5  # 1, 2 and 3 are still c's and d's
    with pytest.raises(HoldCapacityError):
        book.add("e", 5, ((6,), (7,)), 1)
