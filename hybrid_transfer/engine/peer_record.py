"""What one side knows about one peer agent, in one record with one stage (issue 14).

A producer rank keeps one record per consumer agent, a consumer rank one per producer agent:
its authenticated link (key and counters, engine/auth.py; None without a secret), the consumer
rank bound to it, and its stage. ``advance`` is the only place a stage changes.

  producer's view of a consumer agent:  HANDSHAKEN -> WELCOMED (its Hello was answered) -> GONE
  consumer's view of a producer agent:  HANDSHAKEN -> GREETED (Hello sent) -> WELCOMED -> GONE
GONE: a Bye, NIXL reported it disconnected, or it could not be notified; a producer forgets the
record at once, a consumer keeps it (with ``error``) so the requests that depend on it fail.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from hybrid_transfer.engine.auth import Link
from hybrid_transfer.errors import RequestStateError


class PeerStage(enum.Enum):
    HANDSHAKEN = "handshaken"  # the handshake was accepted; no Hello yet
    GREETED = "greeted"  # consumer side: our Hello went out, its Welcome has not come
    WELCOMED = "welcomed"  # Hello answered by a Welcome: READs may go between the two
    GONE = "gone"


_EDGES = {
    PeerStage.HANDSHAKEN: frozenset({PeerStage.GREETED, PeerStage.WELCOMED, PeerStage.GONE}),
    PeerStage.GREETED: frozenset({PeerStage.WELCOMED, PeerStage.GONE}),
    PeerStage.WELCOMED: frozenset({PeerStage.GONE}),
    PeerStage.GONE: frozenset(),
}


@dataclass(eq=False)
class PeerRecord:
    agent: str
    link: Link | None = None  # None without a secret: nothing is sealed
    stage: PeerStage = PeerStage.HANDSHAKEN
    rank: int | None = None  # the consumer rank bound to this agent by its first message (the Hello)
    since: float = 0.0  # when the stage last changed (the owner's clock)
    error: BaseException | None = None  # GONE on a consumer: why (NIXL's disconnect)


def advance(record: PeerRecord, stage: PeerStage, now: float) -> None:
    """The only place a peer's stage changes.

    Raises:
        RequestStateError: not an edge (a bug, never silently ignored).
    """
    if stage not in _EDGES[record.stage]:
        raise RequestStateError(f"illegal peer stage change {record.stage.value} -> {stage.value}",
                                request_id=f"agent {record.agent}", state=record.stage.value)
    record.stage = stage
    record.since = now
