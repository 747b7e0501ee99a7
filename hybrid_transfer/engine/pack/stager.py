"""Pack mode on the producer: gather each held request into staging, tell consumer ranks where it is.

Why gather at hold() and not when a consumer asks: the gather then runs off every consumer's
critical path (DESIGN 3), once per producer rank however many consumers read it. The price is
that the producer does not yet know the consumers (their TP, block sizes, local blocks), so it
gathers in its own canonical order (plan/stage_layout.py), chosen so that any consumer rank's
share is at most two contiguous ranges; and the staged copy lives, like the blocks, until the
request is freed. The protocol, per (request, source rank):

  hold()        gather this rank's valid bytes of the request into a pool slice; CUDA: on the
                copier's stream, so hold() returns before the copy ends
  StagingQuery  a consumer rank asks this rank's side channel where the request is staged
  StagingReply  READY (address, bytes, measured gather time) once the gather has finished;
                PENDING while it runs (the consumer asks again); ABSENT when nothing is staged
                (pool full, pack off, unknown request, wrong nonce): the consumer reads directly
  free          the slice goes back to the pool when the request is freed (every consumer has
                notified, so no READ can still touch it)

Threads: stage, release and close run on the producer's owner thread, which replaces the
directory (a dict of immutable entries) copy-on-write; ``respond`` runs on the handshake
listener thread, reads whichever directory is current, never touches the NIXL agent, and waits
at most PENDING_WAIT_S for a running gather (CUDA event queries) before answering PENDING.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import wire
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.pack.gather_scatter import Arena, Copier, CopyTicket
from hybrid_transfer.engine.pack.staging import StagingPool, StagingSlice
from hybrid_transfer.errors import WireDecodeError
from hybrid_transfer.plan.stage_layout import stage_layout
from hybrid_transfer.plan.types import PlanMode

log = logging.getLogger(__name__)

STAGING_MODES = (PlanMode.PACK, PlanMode.AUTO)  # the modes in which producers stage and consumers read staging
PENDING_WAIT_S = 0.002  # how long the listener waits for a running gather before answering PENDING
_PENDING_POLL_S = 0.0002


@dataclass
class StagerStats:
    """Counters of the owner thread (staged, pool_full) and of the listener thread (the rest)."""

    staged: int = 0
    pool_full: int = 0  # requests held without staging: consumers read them directly
    bytes_staged: int = 0
    queries: int = 0
    ready: int = 0
    pending: int = 0
    absent: int = 0
    malformed: int = 0


@dataclass(frozen=True, eq=False)
class _Entry:
    nonce: int
    piece: StagingSlice
    copy: CopyTicket


class Stager:
    """A producer rank's staging pool, gathers and staging directory.

    Build it before the agent's metadata is read: it registers its pool with the agent.
    """

    def __init__(self, agent: NixlAgent, cache: HybridCache, config: EngineConfig, digest: str):
        self.pool = StagingPool(config.staging_bytes, cache.device)
        agent.register_more([self.pool.region])
        self._copier = Copier(Arena(cache.tensors))
        self._geometry = cache.geometry
        self._tensor_addrs = [r.addr for r in cache.regions]
        self._device_id = self.pool.region.device_id
        self._digest = digest
        self._entries: dict[str, _Entry] = {}  # never mutated: replaced whole (the listener reads it)
        self.stats = StagerStats()

    # ---- owner thread -------------------------------------------------------------------
    def stage(self, request_id: str, nonce: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> bool:
        """Gather a just-held request into a slice; False (and counted) when the pool has no room."""
        layout = stage_layout(self._geometry, self._tensor_addrs, block_ids, num_tokens)
        if layout.total_bytes == 0:
            return False
        piece = self.pool.try_alloc(layout.total_bytes)
        if piece is None:
            self.stats.pool_full += 1
            log.info("stager: no room for %d B of %r (%d of %d B in use): consumers read it directly",
                     layout.total_bytes, request_id, self.pool.bytes_in_use, self.pool.capacity_bytes)
            return False
        try:
            copy = self._copier.gather(layout.addr, layout.length, piece.tensor)
        except BaseException:
            self.pool.free(piece)
            raise
        self._entries = {**self._entries, request_id: _Entry(nonce, piece, copy)}
        self.stats.staged += 1
        self.stats.bytes_staged += layout.total_bytes
        return True

    def release(self, request_id: str) -> None:
        """The request is freed: no consumer READ can touch its slice any more."""
        entry = self._entries.get(request_id)
        if entry is not None:
            self._entries = {k: v for k, v in self._entries.items() if k != request_id}
            entry.copy.wait()  # the gather must not outlive the blocks it reads
            self.pool.free(entry.piece)

    def wait_staged(self, request_id: str) -> bool:
        """Block until the request's gather has finished (benchmarks, tests); False when it is not staged."""
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.copy.wait()
        return entry is not None

    def is_staged(self, request_id: str) -> bool:
        return request_id in self._entries

    def close(self) -> None:
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            entry.copy.wait()

    # ---- listener thread ----------------------------------------------------------------
    def respond(self, data: bytes) -> bytes | None:
        """The reply to a StagingQuery; None for any other message (the handshake answers those)."""
        try:
            env = wire.decode_envelope(data)
        except WireDecodeError:
            return None
        if env.kind is not wire.Kind.STAGING_QUERY:
            return None
        self.stats.queries += 1
        try:
            query = wire.decode_body(env, wire.Kind.STAGING_QUERY)
        except WireDecodeError as exc:
            self.stats.malformed += 1
            return wire.encode(wire.ErrorReply(reason=str(exc)), self._digest)
        if env.fingerprint != self._digest:
            self.stats.malformed += 1
            return wire.encode(wire.ErrorReply(reason="fingerprint differs"), self._digest)
        return wire.encode(self._reply(query), self._digest)  # type: ignore[arg-type]

    def _reply(self, query: wire.StagingQuery) -> wire.StagingReply:
        entry = self._entries.get(query.request_id)
        if entry is None or entry.nonce != query.nonce:
            self.stats.absent += 1
            return wire.StagingReply(request_id=query.request_id, status=wire.StagingStatus.ABSENT)
        deadline = time.monotonic() + PENDING_WAIT_S
        while not entry.copy.is_done:
            if time.monotonic() >= deadline:
                self.stats.pending += 1
                return wire.StagingReply(request_id=query.request_id, status=wire.StagingStatus.PENDING)
            time.sleep(_PENDING_POLL_S)
        self.stats.ready += 1
        return wire.StagingReply(request_id=query.request_id, status=wire.StagingStatus.READY,
                                 addr=entry.piece.addr, nbytes=entry.piece.nbytes, device_id=self._device_id,
                                 gather_s=entry.copy.elapsed_s)
