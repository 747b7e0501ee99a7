"""Leases on the producer's own clock: when each held request's blocks fall due.

Never compared with another host's clock: a ticket carries only the duration. A heap of
(expires_at, request_id) with lazy deletion: a renewal pushes a new entry and the stale one is
skipped when it surfaces, so renewals and expiry checks stay O(log n) however many requests
are held and however often consumers heartbeat.
"""

from __future__ import annotations

import heapq


class LeaseBook:
    """Expiry times of held requests; the caller's clock readings go in, due request ids come out."""

    def __init__(self, lease_s: float):
        self.lease_s = float(lease_s)
        self._until: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []

    def start(self, request_id: str, now: float) -> float:
        """A new lease of ``lease_s`` from ``now``; returns its end."""
        until = now + self.lease_s
        self._until[request_id] = until
        heapq.heappush(self._heap, (until, request_id))
        return until

    def renew(self, request_id: str, now: float) -> float | None:
        """Push the lease's end to ``now + lease_s`` (never earlier); None when no lease runs."""
        old = self._until.get(request_id)
        if old is None:
            return None
        until = now + self.lease_s
        if until > old:
            self._until[request_id] = until
            heapq.heappush(self._heap, (until, request_id))
            return until
        return old

    def drop(self, request_id: str) -> None:
        self._until.pop(request_id, None)

    def expires_at(self, request_id: str) -> float | None:
        return self._until.get(request_id)

    def pop_expired(self, now: float) -> list[str]:
        """Request ids whose lease ended at or before ``now`` (each once; their leases are dropped)."""
        due = []
        while self._heap and self._heap[0][0] <= now:
            until, request_id = heapq.heappop(self._heap)
            if self._until.get(request_id) == until:
                del self._until[request_id]
                due.append(request_id)
        return due

    def __len__(self) -> int:
        return len(self._until)
