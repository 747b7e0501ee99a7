"""Consumer agents a producer rank accepted at the handshake but that have not said Hello yet.

Without a secret the handshake is unauthenticated and costs a peer one message, so what it leaves behind must be
bounded: at most ``capacity`` names (the oldest is evicted first), each dropped ``deadline_s``
after its handshake on the producer's clock. A real consumer says Hello within one of its polls
of the reply; an evicted or expired one that says Hello later is treated as a stranger (its
requests then fail at its read deadline), which is the price of bounding the table. Each entry is
the agent's PeerRecord (engine/peer_record.py), with its link key when a secret is set; its Hello moves
that record to the producer's table of welcomed agents.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from hybrid_transfer.engine.auth import Link
from hybrid_transfer.engine.peer_record import PeerRecord


class PendingHandshakes:
    """Written by the listener thread (``add``) and the owner thread (the rest); one lock guards both."""

    def __init__(self, clock: Callable[[], float], deadline_s: float, capacity: int):
        self._clock = clock
        self._deadline_s = deadline_s
        self._capacity = capacity
        self._lock = threading.Lock()
        self._records: OrderedDict[str, PeerRecord] = OrderedDict()  # oldest first
        self.num_evicted = 0  # pushed out by the cap
        self.num_expired = 0  # dropped at their deadline

    def add(self, agent_name: str, link_key: bytes | None = None) -> None:
        """A handshake from ``agent_name`` was accepted (a repeated one restarts its deadline and its link)."""
        now = self._clock()
        record = PeerRecord(agent_name, Link.for_producer(link_key) if link_key is not None else None, since=now)
        with self._lock:
            self._records.pop(agent_name, None)
            self._records[agent_name] = record
            while len(self._records) > self._capacity:
                self._records.popitem(last=False)
                self.num_evicted += 1

    def __contains__(self, agent_name: object) -> bool:
        with self._lock:
            return agent_name in self._records

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def get(self, agent_name: str) -> PeerRecord | None:
        with self._lock:
            return self._records.get(agent_name)

    def discard(self, agent_name: str) -> None:
        with self._lock:
            self._records.pop(agent_name, None)

    def expire(self) -> int:
        """Drop every name past its deadline; how many were dropped."""
        cutoff = self._clock() - self._deadline_s
        dropped = 0
        with self._lock:
            while self._records:
                name, record = next(iter(self._records.items()))
                if record.since > cutoff:
                    break
                del self._records[name]
                dropped += 1
        self.num_expired += dropped
        return dropped
