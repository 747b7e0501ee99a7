"""Notifications taken from NIXL and not handled yet: each poll() handles a bounded number, in arrival order.

NIXL hands over every notification it buffered in one call (its own buffer is outside our control),
and that call must happen on every poll: it also progresses the target side of READs. A flood from a
peer (garbage, or valid-looking messages from a stranger) would otherwise make one poll() decode and
judge all of it. Here a poll handles at most ``per_poll`` and carries the rest over; what arrives while
the backlog holds ``max_bytes`` is dropped and counted, so a flood cannot grow memory without bound.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence


class Inbox:
    """Owned by the engine's owner thread."""

    def __init__(self, per_poll: int, max_bytes: int):
        self.per_poll = per_poll
        self.max_bytes = max_bytes
        self._queue: deque[tuple[str, bytes]] = deque()
        self._bytes = 0
        self.num_dropped = 0  # arrived while the backlog was full

    def put(self, notifications: Mapping[str, Sequence[bytes]]) -> None:
        """Queue what NIXL handed over (sender -> messages), oldest first."""
        for sender, messages in notifications.items():
            for message in messages:
                size = len(message) + len(sender)
                if self._bytes + size > self.max_bytes:
                    self.num_dropped += 1
                    continue
                self._queue.append((sender, message))
                self._bytes += size

    def take(self) -> list[tuple[str, bytes]]:
        """The next ``per_poll`` notifications at most, in arrival order."""
        batch = []
        while self._queue and len(batch) < self.per_poll:
            sender, message = self._queue.popleft()
            self._bytes -= len(message) + len(sender)
            batch.append((sender, message))
        return batch

    def __len__(self) -> int:
        """Notifications carried over to a later poll."""
        return len(self._queue)

    @property
    def num_bytes(self) -> int:
        return self._bytes
