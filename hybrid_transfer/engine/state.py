"""Request lifecycles: the state enums and the one function that changes a state.

Consumer reads: WAITING_PEER -> READING -> DONE, with FAILED reachable from any
live state, through DRAINING whenever a posted READ may still write the local
blocks (a request is reported only once no handle can write them, DESIGN 4).
Producer holds: HELD -> FREED. Leases, aborts, quarantine and step fences
(issue 5) add states and edges here, not flags elsewhere.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from hybrid_transfer.errors import RequestStateError


class XferState(enum.Enum):
    """One NIXL READ handle."""

    PROC = "PROC"
    DONE = "DONE"
    ERR = "ERR"
    RELEASED = "RELEASED"  # our own: the handle is freed, nothing can write through it any more

    @classmethod
    def parse(cls, status: str) -> XferState:
        """NIXL's status string ("DONE", "PROC", "ERR")."""
        return {"DONE": cls.DONE, "PROC": cls.PROC}.get(status, cls.ERR)


class ReadState(enum.Enum):
    """A consumer request."""

    WAITING_PEER = "waiting_peer"  # the producer engine's handshake is not finished
    READING = "reading"  # READs posted; notifications go out when all are DONE
    DRAINING = "draining"  # failed, but a posted READ may still write: waits until every handle is released
    DONE = "done"  # terminal: bytes in place, every producer rank of plan.notify notified
    FAILED = "failed"  # terminal: no handle can write the local blocks any more


class HoldState(enum.Enum):
    """A producer request."""

    HELD = "held"  # blocks pinned, waiting for consumers
    FREED = "freed"  # terminal: every expected consumer rank notified


_EDGES: dict[enum.Enum, frozenset[enum.Enum]] = {
    ReadState.WAITING_PEER: frozenset({ReadState.READING, ReadState.FAILED}),
    ReadState.READING: frozenset({ReadState.DONE, ReadState.DRAINING, ReadState.FAILED}),
    ReadState.DRAINING: frozenset({ReadState.FAILED}),
    HoldState.HELD: frozenset({HoldState.FREED}),
}
TERMINAL = frozenset({ReadState.DONE, ReadState.FAILED, HoldState.FREED})


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


@dataclass(frozen=True)
class ReadResult:
    """What ``Consumer.poll`` reports for a request that reached a terminal state.

    On failure ``local_block_ids`` (every group, attention and state) are safe to reuse: no
    handle can write them any more, and the embedder must recompute them.
    """

    request_id: str
    state: ReadState
    local_block_ids: tuple[tuple[int, ...], ...]
    num_bytes: int
    num_descriptors: int
    started_at: float
    finished_at: float
    error: BaseException | None = None

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
