"""What the connector's two halves tell each other: per-step orders (scheduler -> workers) and
each worker's identity (workers -> scheduler, once, through vLLM's handshake-metadata path).

Both travel inside vLLM's own messages (SchedulerOutput, the engine core's handshake collection),
which vLLM pickles; tickets are msgspec Structs, which pickle too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata, KVConnectorMetadata

from hybrid_transfer.engine.wire import Ticket


@dataclass
class HandshakeCard(KVConnectorHandshakeMetadata):
    """A producer rank's RankCard (engine/tickets.py) as bytes: what the scheduler issues tickets from."""

    card: bytes


@dataclass(frozen=True)
class ReadOrder:
    """Decode side: read ``ticket`` into ``local_block_ids`` (our group order, every block of the request).

    ``first_token``: the local prefix hit's end; the read starts there (docs/planner.md#prefix-hits).
    """

    ticket: Ticket
    local_block_ids: tuple[tuple[int, ...], ...]
    expected_state_position: int
    first_token: int = 0


@dataclass(frozen=True)
class DeclineOrder:
    """Decode side: tell the ticket's producer ranks this engine will not read it.

    ``report``: also report the request as finished receiving (vLLM waits for it when the request
    was already parked in WAITING_FOR_REMOTE_KVS).
    """

    ticket: Ticket
    report: bool


@dataclass(frozen=True)
class FailOrder:
    """Decode side: report a load that failed before any byte moved (kv_load_failure_policy "fail").

    ``ticket``: the decoded ticket to decline, or None when none decoded (nobody to tell).
    """

    ticket: Ticket | None
    reason: str


@dataclass
class HybridConnectorMetadata(KVConnectorMetadata):
    """One step's orders for every worker of the engine (each acts on its own rank)."""

    holds: dict[str, Ticket] = field(default_factory=dict)  # prefill: pin these (same nonce on every rank)
    reads: dict[str, ReadOrder] = field(default_factory=dict)
    aborts: list[str] = field(default_factory=list)  # decode: reads to abort (ids from earlier steps)
    declines: dict[str, DeclineOrder] = field(default_factory=dict)
    fails: dict[str, FailOrder] = field(default_factory=dict)  # decode: report finished and failed at once

    def is_empty(self) -> bool:
        return not (self.holds or self.reads or self.aborts or self.declines or self.fails)
