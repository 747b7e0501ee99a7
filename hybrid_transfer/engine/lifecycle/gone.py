"""Consumer agents that NIXL reported disconnected, remembered for one lease; no NIXL, the producer's clock.

A dead consumer's claims can still reach its producer after the producer learned it is gone: queued
behind the message whose answer failed (NIXL hands over a poll's notifications together), or kept
for a hold that had not happened yet (lifecycle/early.py). Each such claim revokes its hold at once
(docs/lifecycle.md#reclaim) instead of leaving the blocks pinned until the lease. The agent's record
is kept so that its sealed claims still authenticate under its link.

Bounded: at most ``capacity`` agents (the oldest forgotten first), each for ``lease_s``: a claim names
a ticket whose lease started before the agent died, so once that long has passed none can matter.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from hybrid_transfer.engine.peer_record import PeerRecord


class GoneAgents:
    """Agent name -> its last record, while its claims may still arrive; used by the owner thread only."""

    def __init__(self, clock: Callable[[], float], lease_s: float, capacity: int):
        self._clock = clock
        self._lease_s = float(lease_s)
        self._capacity = int(capacity)
        self._entries: OrderedDict[str, tuple[PeerRecord, float]] = OrderedDict()  # oldest first
        self.num_evicted = 0  # forgotten early because the table was full

    def add(self, record: PeerRecord) -> None:
        self._entries.pop(record.agent, None)
        self._entries[record.agent] = (record, self._clock() + self._lease_s)
        while len(self._entries) > self._capacity:
            self._entries.popitem(last=False)
            self.num_evicted += 1

    def discard(self, agent: str) -> None:
        """The agent was welcomed again (the same process after a broken connection): its claims count again."""
        self._entries.pop(agent, None)

    def get(self, agent: str) -> PeerRecord | None:
        self._prune()
        entry = self._entries.get(agent)
        return entry[0] if entry is not None else None

    def __contains__(self, agent: object) -> bool:
        return self.get(agent) is not None  # type: ignore[arg-type]

    def __len__(self) -> int:
        self._prune()
        return len(self._entries)

    def _prune(self) -> None:
        now = self._clock()
        while self._entries:
            _, (_, until) = next(iter(self._entries.items()))
            if until > now:
                break
            self._entries.popitem(last=False)
