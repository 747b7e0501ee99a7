"""Completions that reach a producer rank before its ``hold()``; no NIXL, the producer's clock.

A serving engine issues a ticket in its scheduler and holds the request on its workers at their
next step, while a consumer may read and report in between (the READ needs no hold: the
scheduler keeps the blocks). Dropping such a completion would pin the blocks for a whole lease,
so each one is kept per (request id, nonce) until the hold takes it in:
- for ``grace_s`` from its arrival, or
- for ``lease_s`` from an ``expect(request_id, nonce)`` (the embedder announced the hold).
At most ``limit`` completions are kept; beyond that the oldest unexpected one goes first, and
every loss is counted. Nothing here frees anything: ``Producer.hold`` replays what it takes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid_transfer.engine.wire import Completion


@dataclass
class _Entry:
    until: float
    expected: bool
    completions: list[tuple[str, Completion]] = field(default_factory=list)  # (sender agent, message)


@dataclass
class EarlyStats:
    kept: int = 0  # completions kept for a hold that had not happened yet
    replayed: int = 0  # ... taken in by their hold
    lapsed: int = 0  # ... whose grace (or expectation) ran out before any hold
    evicted: int = 0  # ... pushed out by newer ones (the buffer was full)


class EarlyCompletions:
    """Completions waiting for their hold, by (request id, nonce); used by the producer's owner thread."""

    def __init__(self, clock: Callable[[], float], grace_s: float, lease_s: float, limit: int):
        self._clock = clock
        self.grace_s = float(grace_s)
        self.lease_s = float(lease_s)
        self.limit = int(limit)
        self._entries: dict[tuple[str, int], _Entry] = {}  # insertion order == arrival order
        self._count = 0
        self.stats = EarlyStats()

    def expect(self, request_id: str, nonce: int) -> None:
        """The embedder will hold this request with this nonce: keep its completions until then (one lease)."""
        until = self._clock() + self.lease_s
        entry = self._entries.get((request_id, nonce))
        if entry is None:
            self._entries[(request_id, nonce)] = _Entry(until, True)
        else:
            entry.until, entry.expected = max(entry.until, until), True

    def is_expected(self, request_id: str, nonce: int) -> bool:
        entry = self._entries.get((request_id, nonce))
        return entry is not None and entry.expected

    def keep(self, sender: str, completion: Completion) -> None:
        """A completion for a request that is not held (yet)."""
        key = (completion.request_id, completion.nonce)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(self._clock() + self.grace_s, False)
        entry.completions.append((sender, completion))
        self._count += 1
        self.stats.kept += 1
        while self._count > self.limit and self._evict_one():
            pass

    def take(self, request_id: str, nonce: int) -> list[tuple[str, Completion]]:
        """Everything kept for this hold, in arrival order (forgotten here)."""
        entry = self._entries.pop((request_id, nonce), None)
        if entry is None:
            return []
        self._count -= len(entry.completions)
        self.stats.replayed += len(entry.completions)
        return entry.completions

    def prune(self) -> int:
        """Forget entries whose time ran out; returns the completions lost."""
        now = self._clock()
        lost = 0
        for key in [k for k, e in self._entries.items() if e.until <= now]:
            lost += len(self._entries.pop(key).completions)
        self._count -= lost
        self.stats.lapsed += lost
        return lost

    @property
    def num_kept(self) -> int:
        return self._count

    def __len__(self) -> int:
        return len(self._entries)

    def _evict_one(self) -> bool:
        """Drop the oldest unexpected entry with completions (else the oldest expected one)."""
        victims = [k for k, e in self._entries.items() if e.completions and not e.expected] or \
                  [k for k, e in self._entries.items() if e.completions]
        if not victims:
            return False
        entry = self._entries.pop(victims[0])
        self._count -= len(entry.completions)
        self.stats.evicted += len(entry.completions)
        return True
