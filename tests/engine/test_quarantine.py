"""Quarantine and Tombstones: blocks leave only when no handle and no unfinished step can write them."""

from __future__ import annotations

from hybrid_transfer.engine.lifecycle.fences import StepFences
from hybrid_transfer.engine.lifecycle.quarantine import Quarantine
from hybrid_transfer.engine.lifecycle.revocations import Tombstones


class Handle:
    def __init__(self, releasable: bool):
        self.releasable = releasable
        self.is_released = False


def _release(h: Handle) -> bool:
    if h.releasable:
        h.is_released = True
    return h.is_released


def test_an_entry_leaves_once_its_handles_are_released_and_its_fences_passed():
    fences = StepFences()
    q = Quarantine(fences)
    stuck = Handle(False)
    handles = [Handle(True), stuck]
    q.add("a", [1, 2], handles)
    q.add("b", [2, 3], [])
    fences.mark([3], 9)
    assert q.sweep(_release) == [] and q.num_blocks == 3 and q.num_handles == 1
    handles.append(Handle(False))  # a READ posted after the failure holds the entry too
    stuck.releasable = True
    assert q.sweep(_release, ["a"]) == [] and q.num_handles == 1
    handles[-1].releasable = True
    assert q.sweep(_release, ["a"]) == ["a"] and q.num_blocks == 2 and "a" not in q
    fences.finish(9)
    assert q.sweep(_release) == ["b"] and q.num_blocks == 0 and q.num_entries == 0


def test_tombstones_lapse_after_their_lease():
    t = Tombstones()
    t.add("r", 5, until=10.0)
    t.add("s", 6, until=20.0)
    t.prune(9.0)
    assert ("r", 5) in t and ("r", 6) not in t
    t.prune(10.0)
    assert ("r", 5) not in t and ("s", 6) in t and len(t) == 1
