"""Completions that reach a producer rank before its ``hold()``; no NIXL, the producer's clock.

A serving engine issues a ticket in its scheduler and holds the request on its workers at their
next step, while a consumer may read and report in between (the READ needs no hold: the
scheduler keeps the blocks). Dropping such a completion would pin the blocks for a whole lease,
so each one is kept per (request id, nonce) until the hold takes it in:
- for ``grace_s`` from its arrival, or
- for ``lease_s`` from an ``expect(request_id, nonce)`` (the embedder announced the hold).
At most ``limit`` completions are kept; beyond that the oldest unexpected one goes first, and
every loss is counted. At most ``limit`` expectations are kept too (the oldest is forgotten).
Nothing here frees anything: ``Producer.hold`` replays what it takes.

Cost (issue 19, row 7): every operation touches O(1) entries, however many are kept. Entries live
in insertion-ordered tables whose order is their deadline order (a grace starts at arrival, an
expectation's lease at its last ``expect``), so eviction takes the first entry and ``prune`` stops
at the first entry still in time. (With ``grace_s > lease_s`` an expectation set on an entry kept
earlier may lapse up to one grace late, never early.)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from hybrid_transfer.engine.wire import Completion

_Key = tuple[str, int]


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
    expectations_dropped: int = 0  # expectations forgotten because ``limit`` of them were kept


class EarlyCompletions:
    """Completions waiting for their hold, by (request id, nonce); used by the producer's owner thread."""

    def __init__(self, clock: Callable[[], float], grace_s: float, lease_s: float, limit: int):
        self._clock = clock
        self.grace_s = float(grace_s)
        self.lease_s = float(lease_s)
        self.limit = int(limit)
        # Unexpected entries (each with completions), in arrival order == grace deadline order.
        self._stray: OrderedDict[_Key, _Entry] = OrderedDict()
        # Expected entries, in order of their last expect() == lease deadline order.
        self._expected: OrderedDict[_Key, _Entry] = OrderedDict()
        # Expected entries holding completions, in the order they got their first: the eviction order once
        # no unexpected completion is left.
        self._expected_kept: OrderedDict[_Key, None] = OrderedDict()
        self._count = 0
        self.stats = EarlyStats()

    def expect(self, request_id: str, nonce: int) -> None:
        """The embedder will hold this request with this nonce: keep its completions until then (one lease)."""
        key = (request_id, nonce)
        until = self._clock() + self.lease_s
        entry = self._expected.pop(key, None)
        if entry is None:
            entry = self._stray.pop(key, None)
            if entry is None:
                entry = _Entry(until, True)
            else:
                entry.expected = True
                self._expected_kept[key] = None
        entry.until = max(entry.until, until)
        self._expected[key] = entry  # last: its lease deadline is the latest
        if len(self._expected) > self.limit:
            old_key, old = self._expected.popitem(last=False)
            self._expected_kept.pop(old_key, None)
            self._count -= len(old.completions)
            self.stats.evicted += len(old.completions)
            self.stats.expectations_dropped += 1

    def is_expected(self, request_id: str, nonce: int) -> bool:
        return (request_id, nonce) in self._expected

    def keep(self, sender: str, completion: Completion) -> None:
        """A completion for a request that is not held (yet)."""
        key = (completion.request_id, completion.nonce)
        entry = self._expected.get(key)
        if entry is not None:
            if not entry.completions:
                self._expected_kept[key] = None
        else:
            entry = self._stray.get(key)
            if entry is None:
                entry = self._stray[key] = _Entry(self._clock() + self.grace_s, False)
        entry.completions.append((sender, completion))
        self._count += 1
        self.stats.kept += 1
        while self._count > self.limit and self._evict_one():
            pass

    def take(self, request_id: str, nonce: int) -> list[tuple[str, Completion]]:
        """Everything kept for this hold, in arrival order (forgotten here)."""
        key = (request_id, nonce)
        entry = self._expected.pop(key, None)
        if entry is None:
            entry = self._stray.pop(key, None)
        else:
            self._expected_kept.pop(key, None)
        if entry is None:
            return []
        self._count -= len(entry.completions)
        self.stats.replayed += len(entry.completions)
        return entry.completions

    def prune(self) -> int:
        """Forget entries whose time ran out; returns the completions lost. Touches the lapsed entries and one more."""
        now = self._clock()
        lost = 0
        for table in (self._stray, self._expected):
            while table:
                key, entry = next(iter(table.items()))
                if entry.until > now:
                    break
                del table[key]
                if entry.expected:
                    self._expected_kept.pop(key, None)
                lost += len(entry.completions)
        self._count -= lost
        self.stats.lapsed += lost
        return lost

    @property
    def num_kept(self) -> int:
        return self._count

    def __len__(self) -> int:
        return len(self._stray) + len(self._expected)

    def _evict_one(self) -> bool:
        """Drop the oldest unexpected entry (else the oldest expected one with completions): O(1)."""
        if self._stray:
            _, entry = self._stray.popitem(last=False)
        elif self._expected_kept:
            key, _ = self._expected_kept.popitem(last=False)
            entry = self._expected.pop(key)
        else:
            return False
        self._count -= len(entry.completions)
        self.stats.evicted += len(entry.completions)
        return True
