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

from dataclasses import dataclass

from hybrid_transfer.engine.auth import Link
from hybrid_transfer.errors import RequestStateError
from hybrid_transfer.identity_enum import IdentityEnum


class PeerStage(IdentityEnum):
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
    slot: str | None = None  # producer side: "<engine id>-c<rank>" of a welcomed consumer agent (consumer_slot)


def consumer_agent_name(engine_id: str, rank: int, token: str) -> str:
    """A consumer rank's NIXL agent name: ``token`` is new in every process (its incarnation)."""
    return f"{engine_id}-c{rank}-{token}"


def consumer_slot(agent: str, rank: int) -> str | None:
    """The engine rank a consumer agent serves (its name less the token), or None for a name of another form.

    Two welcomed agents with one slot are two incarnations of one consumer rank: the older is gone.
    The name is the agent's own claim, authenticated only as far as its link is (with a secret).
    """
    head, sep, token = agent.rpartition("-")
    return head if sep and token and head.endswith(f"-c{rank}") and len(head) > len(f"-c{rank}") else None


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
