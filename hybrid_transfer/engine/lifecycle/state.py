"""Request lifecycles: the state enums and the one function that changes a state.

Consumer reads: WAITING_PEER -> READING -> DONE. A failure passes through DRAINING and an
abort by the embedder through ABORTING: the local blocks sit in quarantine until no NIXL
handle and no unfinished engine step can write them, and only then is the request FAILED or
ABORTED and reported (docs/lifecycle.md#consumer-states: a reported request's blocks are safe to reuse).

Producer holds: HELD -> FREED (every expected consumer rank reported), EXPIRED (the lease ran
out on the producer's clock) or ABORTED. An abort goes straight to ABORTED when no consumer
agent can be reading; otherwise through ABORTING until every such agent has acknowledged the
revocation, or the lease expires. A terminal hold's blocks are released to the embedder once
their step fences have passed (fences.py).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from hybrid_transfer.errors import RequestStateError
from hybrid_transfer.identity_enum import IdentityEnum


class ReadState(IdentityEnum):
    """A consumer request."""

    WAITING_PEER = "waiting_peer"  # the producer engine's handshake (or its welcome) is not finished
    READING = "reading"  # READs posted; notifications go out when all are DONE
    DRAINING = "draining"  # failed: blocks quarantined until no handle and no unfinished step can write them
    ABORTING = "aborting"  # aborted by the embedder: blocks quarantined likewise
    DONE = "done"  # terminal: bytes in place, every producer rank of plan.notify notified
    FAILED = "failed"  # terminal: ``cause`` says why; nothing can write the local blocks any more
    ABORTED = "aborted"  # terminal: aborted by the embedder; nothing can write the local blocks any more


class FailureCause(IdentityEnum):
    """Why a consumer request FAILED (ReadResult.cause)."""

    HANDSHAKE = "handshake"  # the producer engine could not be linked (refused, unreachable)
    PLAN = "plan"  # the ticket cannot be planned against the linked engine
    NIXL = "nixl"  # a READ was refused or ended in error
    SOURCE_LOST = "source_lost"  # a producer rank disappeared (NIXL reports its agent disconnected)
    DEADLINE = "deadline"  # read_deadline_s passed first
    REVOKED = "revoked"  # the producer aborted the request or its lease expired
    TICKET_REPLAYED = "ticket_replayed"  # the producer did not confirm the claim: already claimed, or ended
    TICKET_EDITED = "ticket_edited"  # the ticket's fields differ from the producer's record of it
    BYTE_COUNT = "byte_count"  # the READs moved other bytes than the layout says the request needs (engine/metrics.py)


class HoldState(IdentityEnum):
    """A producer request."""

    HELD = "held"  # blocks pinned, waiting for consumers
    ABORTING = "aborting"  # aborted while consumer agents may read: waits for their acks or the lease
    FREED = "freed"  # terminal: every expected consumer rank reported (done, aborted or failed)
    EXPIRED = "expired"  # terminal: the lease ran out before that
    ABORTED = "aborted"  # terminal: aborted by the embedder


_EDGES: dict[enum.Enum, frozenset[enum.Enum]] = {
    ReadState.WAITING_PEER: frozenset({ReadState.READING, ReadState.DRAINING, ReadState.ABORTING}),
    ReadState.READING: frozenset({ReadState.DONE, ReadState.DRAINING, ReadState.ABORTING}),
    ReadState.DRAINING: frozenset({ReadState.FAILED}),
    ReadState.ABORTING: frozenset({ReadState.ABORTED}),
    HoldState.HELD: frozenset({HoldState.FREED, HoldState.EXPIRED, HoldState.ABORTING, HoldState.ABORTED}),
    HoldState.ABORTING: frozenset({HoldState.ABORTED}),
}
TERMINAL = frozenset({ReadState.DONE, ReadState.FAILED, ReadState.ABORTED, HoldState.FREED, HoldState.EXPIRED,
                      HoldState.ABORTED})
ENDING = frozenset({ReadState.DRAINING, ReadState.ABORTING})  # quarantined, not yet reported


@dataclass(eq=False)
class ReadRequest:
    """Everything a consumer tracks for one request; ``state`` changes only through ``transition``."""

    request_id: str
    ticket: Any  # wire.Ticket
    local_block_ids: tuple[tuple[int, ...], ...]
    link: Any  # peers.EngineLink of the ticket's producer engine
    started_at: float
    deadline: float
    state: ReadState = ReadState.WAITING_PEER
    changed_at: float = 0.0
    handles: list = field(default_factory=list)  # agent.XferHandle, one per source rank
    notify: tuple = ()  # plan.notify: (source_rank, expected_consumers) pairs
    num_bytes: int = 0
    num_descriptors: int = 0
    error: BaseException | None = None
    cause: FailureCause | None = None
    awaiting_claims: set = field(default_factory=set)  # source agents that have not confirmed our claim (engine/claims.py)
    disowned: bool = False  # a claim was refused: this rank tells the producers nothing about the request
    digest: bytes = b""  # claims.ticket_digest of the ticket, kept for its claim (a step's claims go out together)
    first_token: int = 0  # a local prefix hit's end: tokens [0, first_token) are not read (docs/planner.md#prefix-hits)
    # The blocks the read writes: local_block_ids less the prefix hit's attention blocks, which other requests
    # may share and nothing here writes. Owned, quarantined and reported; () until registered.
    written_block_ids: tuple[tuple[int, ...], ...] = ()
    result_fields: dict | None = None  # DONE: PackReader.result_fields, taken once when it completed


@dataclass(eq=False)
class Hold:
    """A producer's pinned request; ``heard`` maps consumer rank -> agent name of each valid notification."""

    request_id: str
    nonce: int
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    held_at: float
    state: HoldState = HoldState.HELD
    changed_at: float = 0.0
    expected_consumers: int | None = None  # set by the first valid notification
    heard: dict[int, str] = field(default_factory=dict)
    expires_at: float = math.inf  # end of the lease on the producer's clock; heartbeats push it back
    awaiting_acks: set[str] = field(default_factory=set)  # ABORTING: consumer agents yet to confirm the revocation
    digest: bytes = b""  # claims.ticket_digest of the ticket this hold honours
    claimed: dict[int, str] = field(default_factory=dict)  # consumer rank -> agent, for each confirmed claim


@dataclass(frozen=True)
class ReadResult:
    """What ``Consumer.poll`` reports for a request that reached a terminal state.

    On failure ``local_block_ids`` (every group, attention and state, less a prefix hit's attention
    blocks, which the read never writes) are safe to reuse: no handle can write them any more, and the
    embedder must recompute them.
    """

    request_id: str
    state: ReadState
    local_block_ids: tuple[tuple[int, ...], ...]
    num_bytes: int
    num_descriptors: int
    started_at: float
    finished_at: float
    error: BaseException | None = None
    cause: FailureCause | None = None  # FAILED only
    # Timings (engine/pack/reader.py); the transfer time is finished_at - posted_at, scatter included.
    posted_at: float = 0.0  # the request's sources posted (direct READs, staged ones); 0.0 when nothing was
    gather_s: float = 0.0  # pack: the producers' gather (off this request's critical path), slowest source
    read_s: float = 0.0  # post until every READ was DONE (pack: any wait for the Staged notification included)
    query_s: float = 0.0  # pack: post until the source's Staged notification (0 if it came first), slowest source
    scatter_s: float = 0.0  # pack: the scatters into the local blocks, summed over sources
    num_packed_sources: int = 0  # sources read through staging
    num_fallback_sources: int = 0  # pack / auto sources read directly after all (staging absent or full)
    unstaged_sources: tuple[int, ...] = ()  # pack / auto: source ranks that do not stage at all (read directly)

    @property
    def ok(self) -> bool:
        return self.state is ReadState.DONE


def transition(record: ReadRequest | Hold, new: ReadState | HoldState, now: float) -> None:
    """The only place a request's state changes.

    Raises:
        RequestStateError: the change is not an edge of the lifecycle (a bug, never silently ignored).
    """
    if new not in _EDGES.get(record.state, frozenset()):
        raise RequestStateError(f"illegal state change {record.state.value} -> {new.value}",
                                request_id=record.request_id, state=record.state.value)
    record.state = new
    record.changed_at = now
