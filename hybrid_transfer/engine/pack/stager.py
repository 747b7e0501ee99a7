"""Pack mode on the producer: gather each held request into staging, tell consumer agents where it is.

Why gather at hold() and not when a consumer asks: the gather then runs off every consumer's
critical path (docs/planner.md#pack), once per producer rank however many consumers read it. The price
is that the producer does not yet know the consumers (their TP, block sizes, local blocks), so it
gathers in its own canonical order (plan/stage_layout.py), chosen so that any consumer rank's
share is at most two contiguous ranges; and the staged copy lives, like the blocks, until the
request is freed. Per (request, producer rank):

  hold()    gather this rank's valid bytes of the request into a pool slice; CUDA: on the
            copier's stream, so hold() returns before the copy ends. No room: the request is
            held unstaged (ABSENT), and consumers read it directly
  ready()   once the gather has finished (hold() itself on CPU, a later poll() on CUDA), one
            Staged notification (READY: address, bytes, gather time; or ABSENT) for the producer
            to send to every consumer agent it welcomed; ``current()`` lists them again for an
            agent welcomed later. Consumers post their READ when it arrives: no query round trip
  release   the slice goes back to the pool when the request is freed (every consumer has
            notified, so no READ can still touch it)

Owned by the producer's owner thread (hold, poll, close); the side channel never reads it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import wire
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.pack.gather_scatter import Arena, Copier, CopyTicket
from hybrid_transfer.engine.pack.staging import StagingPool, StagingSlice
from hybrid_transfer.plan.stage_layout import stage_layout
from hybrid_transfer.plan.types import PlanMode

log = logging.getLogger(__name__)

STAGING_MODES = (PlanMode.PACK, PlanMode.AUTO)  # the modes in which producers stage and consumers read staging


@dataclass
class StagerStats:
    staged: int = 0
    pool_full: int = 0  # requests held without staging: consumers read them directly
    bytes_staged: int = 0
    announced: int = 0  # requests whose Staged notification is out (READY or ABSENT)


@dataclass(eq=False)
class _Entry:
    nonce: int
    piece: StagingSlice | None  # None: held unstaged (ABSENT)
    copy: CopyTicket | None
    message: wire.Staged | None = None  # set once the gather is done: what consumer agents are told


class Stager:
    """A producer rank's staging pool, gathers and ready notifications.

    Build it before the agent's metadata is read: it registers its pool with the agent.
    """

    def __init__(self, agent: NixlAgent, cache: HybridCache, config: EngineConfig, digest: str):
        self.pool = StagingPool(config.staging_bytes, cache.device)
        agent.register_more([self.pool.region])
        self._copier = Copier(Arena(cache.tensors))
        self._geometry = cache.geometry
        self._tensor_addrs = [r.addr for r in cache.regions]
        self._device_id = self.pool.region.device_id
        self._entries: dict[str, _Entry] = {}
        self._gathering: list[str] = []  # staged, not announced yet, in hold order
        self.stats = StagerStats()

    def stage(self, request_id: str, nonce: int, block_ids: Sequence[Sequence[int]], num_tokens: int) -> bool:
        """Gather a just-held request into a slice; False (held ABSENT, counted) when the pool has no room."""
        layout = stage_layout(self._geometry, self._tensor_addrs, block_ids, num_tokens)
        if layout.total_bytes == 0:
            return False  # nothing to read: no consumer waits for it
        piece = self.pool.try_alloc(layout.total_bytes)
        if piece is None:
            self.stats.pool_full += 1
            log.info("stager: no room for %d B of %r (%d of %d B in use): consumers read it directly",
                     layout.total_bytes, request_id, self.pool.bytes_in_use, self.pool.capacity_bytes)
            self._entries[request_id] = _Entry(nonce, None, None)
            self._gathering.append(request_id)
            return False
        try:
            copy = self._copier.gather(layout.addr, layout.length, piece.tensor)
        except BaseException:
            self.pool.free(piece)
            raise
        self._entries[request_id] = _Entry(nonce, piece, copy)
        self._gathering.append(request_id)
        self.stats.staged += 1
        self.stats.bytes_staged += layout.total_bytes
        return True

    def ready(self) -> list[wire.Staged]:
        """Ready notifications of requests whose gather finished since the last call, in hold order."""
        out, left = [], []
        for request_id in self._gathering:
            entry = self._entries.get(request_id)
            if entry is None:  # released before its gather was seen done
                continue
            if entry.copy is not None and not entry.copy.is_done:
                left.append(request_id)
                continue
            if entry.piece is None:
                entry.message = wire.Staged(request_id=request_id, nonce=entry.nonce,
                                            status=wire.StagingStatus.ABSENT)
            else:
                entry.message = wire.Staged(request_id=request_id, nonce=entry.nonce,
                                            status=wire.StagingStatus.READY, addr=entry.piece.addr,
                                            nbytes=entry.piece.nbytes, device_id=self._device_id,
                                            gather_s=entry.copy.elapsed_s)
            out.append(entry.message)
        self._gathering = left
        self.stats.announced += len(out)
        return out

    def current(self) -> list[wire.Staged]:
        """Every ready notification already sent, for a consumer agent welcomed after it went out."""
        return [e.message for e in self._entries.values() if e.message is not None]

    def release(self, request_id: str) -> None:
        """The request is freed: no consumer READ can touch its slice any more."""
        entry = self._entries.pop(request_id, None)
        if entry is not None and entry.piece is not None:
            entry.copy.wait()  # the gather must not outlive the blocks it reads
            self.pool.free(entry.piece)

    def wait_staged(self, request_id: str) -> bool:
        """Block until the request's gather has finished (benchmarks, tests); False when it is not staged."""
        entry = self._entries.get(request_id)
        if entry is not None and entry.copy is not None:
            entry.copy.wait()
        return entry is not None and entry.piece is not None

    def is_staged(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.piece is not None

    def close(self) -> None:
        entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            if entry.copy is not None:
                entry.copy.wait()
