"""A consumer rank's declines: tickets it will not read, waiting for their producer engine's link.

``Consumer.decline`` adds one; once the engine's link is ready every producer rank the rank would have
read from (or notified) is told ABORTED, so it frees early instead of at lease expiry. Bounded
(MAX_PENDING_DECLINES) and each entry has a deadline (the handshake timeout): beyond either, the
decline is dropped and the producer's lease frees the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from hybrid_transfer.engine import wire
from hybrid_transfer.engine.peers import EngineLink, LinkState

log = logging.getLogger(__name__)

MAX_PENDING_DECLINES = 4096  # declines waiting for their engine's link; beyond, the producer's lease frees them


@dataclass
class _Decline:
    ticket: wire.Ticket
    link: EngineLink
    deadline: float


class Declines:
    """(request id, nonce) -> a decline waiting for its link; owned by the consumer's thread."""

    def __init__(self, name: str):
        self._name = name
        self._waiting: dict[tuple[str, int], _Decline] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, key: object) -> bool:
        return key in self._waiting

    def links(self) -> set[EngineLink]:
        """The links these declines wait for (they must not be evicted)."""
        return {d.link.resolve() for d in self._waiting.values()}

    def add(self, ticket: wire.Ticket, link: EngineLink, deadline: float) -> None:
        self._waiting[(ticket.request_id, ticket.nonce)] = _Decline(ticket, link, deadline)

    def advance(self, now: float, notify: Callable[[wire.Ticket, EngineLink], None]) -> tuple[int, int]:
        """Send the declines whose link is ready (``notify``), drop failed or late ones; (sent, dropped)."""
        sent = dropped = 0
        for key, decline in list(self._waiting.items()):
            link = decline.link.resolve()
            if link.state is LinkState.READY:
                del self._waiting[key]
                notify(decline.ticket, link)
                sent += 1
            elif link.state is LinkState.FAILED or now >= decline.deadline:
                del self._waiting[key]
                dropped += 1
                log.info("consumer %s: decline of %r dropped (%s); the producer's lease frees it", self._name,
                         decline.ticket.request_id, link.error or "handshake deadline")
        return sent, dropped
