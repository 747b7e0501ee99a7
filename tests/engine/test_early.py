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
