"""A consumer rank's memory of revoked tickets (producer aborts and expired leases).

A revocation names (request id, nonce) and is kept for the lease it came with: the ticket's
lease started before the revocation was sent, so once that long has passed on this side no live
ticket can match it any more, and the memory stays bounded.
"""

from __future__ import annotations


class Tombstones:
    """(request id, nonce) -> the time on this consumer's clock after which it may be forgotten."""

    def __init__(self):
        self._until: dict[tuple[str, int], float] = {}
        self._next_prune = float("inf")

    def add(self, request_id: str, nonce: int, until: float) -> None:
        key = (request_id, int(nonce))
        self._until[key] = max(until, self._until.get(key, until))
        self._next_prune = min(self._next_prune, until)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._until

    def prune(self, now: float) -> None:
        """Forget lapsed revocations (cheap when nothing lapsed)."""
        if now < self._next_prune:
            return
        self._until = {k: u for k, u in self._until.items() if u > now}
        self._next_prune = min(self._until.values(), default=float("inf"))

    def __len__(self) -> int:
        return len(self._until)
