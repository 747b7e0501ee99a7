"""Completions kept for a hold that has not happened yet: grace, expectations, the bound (no NIXL)."""

from __future__ import annotations

from hybrid_transfer.engine.lifecycle.early import EarlyCompletions
from hybrid_transfer.engine.wire import Completion


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _done(rid: str, nonce: int = 7, rank: int = 0) -> Completion:
    return Completion(request_id=rid, nonce=nonce, consumer_rank=rank, expected_consumers=2)


def test_a_kept_completion_is_taken_by_its_hold_within_the_grace():
    clock = Clock()
    early = EarlyCompletions(clock, grace_s=5.0, lease_s=100.0, limit=10)
    early.keep("a", _done("r", rank=0))
    early.keep("b", _done("r", rank=1))
    clock.now = 4.9
    assert early.prune() == 0
    assert early.take("r", 8) == []  # another ticket's nonce takes nothing
    assert [(s, c.consumer_rank) for s, c in early.take("r", 7)] == [("a", 0), ("b", 1)]
    assert early.num_kept == 0 and len(early) == 0
    assert (early.stats.kept, early.stats.replayed, early.stats.lapsed) == (2, 2, 0)


def test_without_a_hold_the_grace_lapses_on_the_injected_clock():
    clock = Clock()
    early = EarlyCompletions(clock, grace_s=5.0, lease_s=100.0, limit=10)
    early.keep("a", _done("r"))
    clock.now = 5.0
    assert early.prune() == 1
    assert early.take("r", 7) == [] and early.stats.lapsed == 1 and early.num_kept == 0


def test_an_expected_request_keeps_its_completions_for_a_lease():
    clock = Clock()
    early = EarlyCompletions(clock, grace_s=5.0, lease_s=100.0, limit=10)
    early.expect("r", 7)
    assert early.is_expected("r", 7) and not early.is_expected("r", 8)
    clock.now = 50.0
    early.keep("a", _done("r"))
    clock.now = 99.0
    assert early.prune() == 0
    assert len(early.take("r", 7)) == 1
    early.expect("gone", 1)
    clock.now = 199.0
    early.prune()
    assert len(early) == 0  # an expectation that no hold claimed lapses after one lease


def test_the_bound_evicts_the_oldest_unexpected_completions_first():
    clock = Clock()
    early = EarlyCompletions(clock, grace_s=5.0, lease_s=100.0, limit=3)
    early.expect("wanted", 7)
    early.keep("a", _done("wanted"))
    for i in range(4):
        early.keep("a", _done(f"stray-{i}"))
    assert early.num_kept == 3 and early.stats.evicted == 2
    assert len(early.take("wanted", 7)) == 1
    assert early.take("stray-0", 7) == [] and early.take("stray-1", 7) == []
    assert len(early.take("stray-3", 7)) == 1


# ---- cost: O(1) entries per operation, counted in executed lines, never timed (issue 19, row 7) -------------


def _lines_in_early(fn) -> int:
    """Lines of engine/lifecycle/early.py executed while ``fn()`` runs (a loop over n entries runs n lines)."""
    import sys

    from hybrid_transfer.engine.lifecycle import early as module

    count = [0]

    def local(frame, event, arg):
        if event == "line":
            count[0] += 1
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == module.__file__ else None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count[0]


def _full_table(n: int) -> tuple[Clock, EarlyCompletions]:
    """A table at its bound: n stray completions from a handshaken stranger and n/4 expected requests."""
    clock = Clock()
    early = EarlyCompletions(clock, grace_s=30.0, lease_s=120.0, limit=n)
    for i in range(n // 4):
        early.expect(f"wanted-{i}", 1)
    for i in range(n):
        early.keep("stranger", _done(f"stray-{i}"))
    clock.now = 1.0
    return clock, early


def test_eviction_and_pruning_touch_a_constant_number_of_entries_whatever_the_table_holds():
    """40,000 kept completions (the issue's stranger) cost a keep() and a poll's prune() what 100 do."""
    costs = {}
    for n in (100, 40_000):
        clock, early = _full_table(n)
        keep = _lines_in_early(lambda early=early: early.keep("stranger", _done("one-more")))
        assert early.stats.evicted == 1 and early.num_kept == n  # the oldest stray went
        prune = _lines_in_early(early.prune)  # nothing has lapsed: a poll's usual call
        expect = _lines_in_early(lambda early=early: early.expect("late", 1))
        take = _lines_in_early(lambda early=early: early.take("stray-7", 7))
        costs[n] = (keep, prune, expect, take)
    assert costs[100] == costs[40_000], costs


def test_expectations_are_bounded_too_and_eviction_falls_back_to_expected_completions():
    clock = Clock()
    early = EarlyCompletions(clock, grace_s=5.0, lease_s=100.0, limit=2)
    early.keep("a", _done("x"))
    early.expect("x", 7)  # an entry kept before its expectation becomes expected
    early.expect("y", 7)
    early.keep("a", _done("y"))
    early.keep("a", _done("y", rank=1))  # three kept, no stray left: the oldest expected with completions goes
    assert early.num_kept == 2 and early.stats.evicted == 1 and not early.is_expected("x", 7)
    early.expect("z", 7)
    early.expect("w", 7)  # a third expectation: the oldest ("y", with its two completions) is forgotten
    assert early.stats.expectations_dropped == 1 and early.num_kept == 0 and len(early) == 2
