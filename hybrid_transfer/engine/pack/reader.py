"""Pack mode on the consumer: per source, a direct read or a staged one, as the plan says.

The plan (plan/planner.py) decides per source: a SourcePlan is read directly, a PackSourcePlan
through the source's staging (its read ranges and scatter pieces are the plan's; nothing is
mapped here). The producer side is stager.py: when a source's gather is done it sends every
consumer agent it welcomed a Staged notification with the staged range (no query round trip).
A staged source's steps (steps.py, changed only through ``step_to``):

  WAITING     the source's Staged notification has not arrived yet (it often has: then this
              step is skipped); kept here when it arrives first, bounded (NOTE_LIMIT)
  READING     READY: a slice of this rank's pool is taken and one READ of the plan's ranges (at
              most two) is posted into it
  SCATTERING  the READ is DONE: one index kernel copies the slice into the local blocks
  DONE        the scatter has finished (CUDA: its event completed)
  DIRECT      fallback: the plan's direct rows went out as one READ, because the source staged
              nothing (ABSENT: its pool was full), does not stage at all (its Welcome said so),
              this rank's pool had no room (fallback, never a wait: see config.py), the staged
              size disagreed with the plan's (a bug, logged as a warning), or no notification came
              within STAGED_WAIT_S (it was dropped: a full notification backlog, or evicted here)

With read_batching "per_step" a READY source's READ is queued instead, and ``flush`` (called by the
consumer at the end of each of its calls) posts every queued one as one READ per producer agent, each
source holding a SharedRead of it (docs/lifecycle.md#batched-reads).

Every fallback is counted (PackStats, ReadResult.num_fallback_sources). A producer rank that does
not stage is named once in the log (a warning) and in every ReadResult it serves
(``unstaged_sources``). The consumer notifies only once every source is DONE or DIRECT with its
READ done, so completion follows the scatter. Slices are freed in ``forget``, once the request is
terminal (no handle can write them), after waiting for any scatter still queued. Owned by the
consumer's owner thread; it also keeps the timings every request reports (post, READs done,
gather and scatter times).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import wire
from hybrid_transfer.engine.agent import NixlAgent, SharedRead, XferHandle, XferState
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.lifecycle.state import ReadState
from hybrid_transfer.engine.pack.calibrate import calibrate, cost_model, initial_cost
from hybrid_transfer.engine.pack.gather_scatter import Arena, Copier, CopyTicket
from hybrid_transfer.engine.pack.stager import STAGING_MODES
from hybrid_transfer.engine.pack.staging import StagingPool, StagingSlice
from hybrid_transfer.engine.pack.steps import SETTLED, SourceStep, step_to
from hybrid_transfer.errors import EngineError, HybridTransferError
from hybrid_transfer.plan.cost import CostModel, preset_for
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode

log = logging.getLogger(__name__)

NOTE_LIMIT = 4096  # Staged notifications kept for requests not posted yet (every welcomed agent gets each)
STAGED_WAIT_S = 1.0  # a posted source waits this long for its Staged notification, then reads directly


@dataclass
class PackStats:
    packed_sources: int = 0
    staged_reads: int = 0  # READs posted for them (read_batching "per_step": one per producer agent per call)
    fallback_absent: int = 0  # the source staged nothing for this request (its pool was full)
    fallback_unstaged: int = 0  # the source does not stage at all (not in pack or auto mode)
    fallback_pool_full: int = 0  # this rank's pool had no room for the read
    fallback_mismatch: int = 0  # the source's staged size disagreed with the plan's
    fallback_unannounced: int = 0  # no Staged notification within STAGED_WAIT_S
    notes: int = 0  # Staged notifications taken in
    notes_ready: int = 0  # ... already there when the source was posted (no wait at all)
    notes_waited: int = 0  # ... that a posted source was waiting for
    notes_evicted: int = 0  # ... dropped unused at NOTE_LIMIT (requests or sources this rank does not read)


@dataclass(eq=False)
class _Source:
    plan: PackSourcePlan  # the planner's: read ranges of the source's staging, scatter pieces, direct rows
    address: str
    peer: str
    step: SourceStep = SourceStep.WAITING
    piece: StagingSlice | None = None
    handle: XferHandle | None = None
    copy: CopyTicket | None = None
    gather_s: float = 0.0
    posted_at: float = 0.0
    answered_at: float | None = None  # its Staged notification taken in
    read_posted_at: float | None = None


@dataclass(eq=False)
class _Track:
    req: Any  # state.ReadRequest
    posted_at: float
    sources: dict[int, _Source] = field(default_factory=dict)
    read_done_at: float | None = None
    scatter_s: float = 0.0
    fallbacks: int = 0
    unstaged: list[int] = field(default_factory=list)  # source ranks that do not stage at all
    error: HybridTransferError | None = None


class PackReader:
    """A consumer rank's pack reads, staging pool and per-request timings."""

    def __init__(self, agent: NixlAgent, cache: HybridCache, config: EngineConfig, digest: str,
                 clock: Callable[[], float], *, reads: Any = None):
        # READs are posted and checked through the consumer's transport seam (engine/mapped/transport.py)
        # when given: a direct source of a mapped producer is one copy; staging is always read over NIXL.
        self._agent = reads if reads is not None else agent
        self._clock = clock  # read afresh after copies: on CPU a READ or a scatter runs inside the call
        self._rank = cache.geometry.tp_rank
        self._config = config
        self._digest = digest
        self.enabled = config.mode in STAGING_MODES
        self.stats = PackStats()
        self.cost = initial_cost(config, cache.device.type == "cuda")  # docs/planner.md#auto
        self._on_gpu = cache.device.type == "cuda"
        self.pool: StagingPool | None = None
        self._tracks: dict[str, _Track] = {}
        self._stages: dict[str, bool] = {}  # producer agent -> whether it stages (its Welcome)
        self._warned: set[str] = set()  # producer agents named once as not staging
        self._notes: collections.OrderedDict = collections.OrderedDict()  # (agent, request id) -> Staged
        self._waiting: dict[tuple[str, str], tuple[_Track, _Source]] = {}  # (agent, request id) -> waiter
        # read_batching "per_step" (engine/read_batch.py): staged READs ready during one consumer call, per
        # producer agent, posted together by flush() as one READ per agent.
        self._batched = config.read_batching == "per_step"
        self._ready: dict[str, list[tuple[_Track, _Source, StagingSlice, wire.Staged, np.ndarray, np.ndarray]]] = {}
        if not self.enabled:
            return
        self.pool = StagingPool(config.staging_bytes, cache.device)
        agent.register_more([self.pool.region])
        self._device_id = self.pool.region.device_id
        self._copier = Copier(Arena(cache.tensors))
        if config.mode is PlanMode.AUTO and config.cost is None and config.calibrate:
            self.cost = cost_model(calibrate(agent, self.pool, self._copier))

    def cost_for(self, link: Any) -> CostModel:
        """The cost model for a link's reads: its transport's preset (docs/planner.md#auto-across-transports),
        unless the config gives (or calibrated) one, which then holds for every transport."""
        transports = set(link.transports.values()) if link is not None else set()
        if self._config.cost is not None or self._config.calibrate or transports <= {"nixl"}:
            return self.cost
        return preset_for(self._on_gpu, "mapped")

    @property
    def plan_mode(self) -> PlanMode:
        """The planner mode to ask for (with ``cost``): pack and auto plans say which sources go through staging."""
        return self._config.mode

    # ---- posting --------------------------------------------------------------------
    def on_post(self, req: Any, now: float) -> None:
        self._tracks[req.request_id] = _Track(req, now)

    def post(self, req: Any, src: Any, link: Any) -> bool:
        """Start one source's read: the per-source choice between a direct and a staged read.

        The planner made it (a PackSourcePlan is staged, a SourcePlan direct); True when a direct READ
        went out now. Raises EngineError when NIXL refused a direct READ (nothing was added).
        """
        if not self.enabled or not isinstance(src, PackSourcePlan) or src.num_descriptors == 0:
            _add_handle(req, self._agent.post_read(link.agents[src.source_rank], src.local_descs(),
                                                   src.remote_descs()))
            return True
        self._start_staged(req, src, link)
        return False

    def _start_staged(self, req: Any, src: PackSourcePlan, link: Any) -> None:
        peer = link.agents[src.source_rank]
        source = _Source(src, req.ticket.addresses[src.source_rank], peer, posted_at=self._clock())
        track = self._tracks[req.request_id]
        track.sources[src.source_rank] = source
        if not self._stages.get(peer, False):  # its Welcome said it does not stage: no notification comes
            self._note_unstaged(track, source)
            self._fallback(track, source, "fallback_unstaged")
            return
        key = (peer, req.request_id)
        note = self._notes.pop(key, None)
        if note is not None and note.nonce == req.ticket.nonce:
            self.stats.notes_ready += 1
            self._on_note(track, source, note)
        else:
            self._waiting[key] = (track, source)

    # ---- notifications ----------------------------------------------------------------
    def on_welcome(self, peer: str, stages: bool) -> None:
        """A producer agent's Welcome: whether it stages (and so sends a Staged for every request)."""
        self._stages[peer] = stages

    def forget_agent(self, peer: str) -> None:
        """A producer agent's link is gone (evicted or replaced): drop what we kept per agent, so the tables
        hold at most the agents of the links held (docs/limits.md#consumer-links)."""
        self._stages.pop(peer, None)
        self._warned.discard(peer)

    def on_staged(self, peer: str, note: wire.Staged) -> None:
        """A producer agent says where it staged a request: post the waiting source's READ, or keep it."""
        self.stats.notes += 1
        if not self.enabled:
            return
        key = (peer, note.request_id)
        waiter = self._waiting.get(key)
        if waiter is not None and waiter[0].req.ticket.nonce == note.nonce:
            del self._waiting[key]
            self.stats.notes_waited += 1
            # A request already ending (failed, aborted, revoked) posts nothing: its quarantine would wait for it.
            if waiter[0].req.state is ReadState.READING:
                self._on_note(*waiter, note)
            return
        self._notes[key] = note
        self._notes.move_to_end(key)
        while len(self._notes) > NOTE_LIMIT:
            self._notes.popitem(last=False)
            self.stats.notes_evicted += 1

    def expire_waits(self) -> None:
        """Sources that waited STAGED_WAIT_S for their notification read directly (it was dropped)."""
        if not self._waiting:
            return
        now = self._clock()
        for key, (track, source) in list(self._waiting.items()):
            if track.req.state is not ReadState.READING:
                del self._waiting[key]  # ending: nothing more to post
            elif now - source.posted_at >= STAGED_WAIT_S:
                del self._waiting[key]
                log.warning("request %r, source %s: no Staged notification after %.3f s; reading it directly",
                            track.req.request_id, source.address, STAGED_WAIT_S)
                self._fallback(track, source, "fallback_unannounced")

    def _on_note(self, track: _Track, source: _Source, note: wire.Staged) -> None:
        source.answered_at = self._clock()
        if note.status is wire.StagingStatus.READY:
            self._post_staged(track, source, note)
        else:
            self._fallback(track, source, "fallback_absent")

    def _note_unstaged(self, track: _Track, source: _Source) -> None:
        if source.peer not in self._warned:
            self._warned.add(source.peer)
            log.warning("producer rank %d at %s (agent %s) does not stage (its mode is not pack or auto): this %s "
                        "consumer reads from it directly", source.plan.source_rank, source.address, source.peer,
                        self._config.mode.value)
        track.unstaged.append(source.plan.source_rank)

    def _post_staged(self, track: _Track, source: _Source, reply: wire.Staged) -> None:
        t = track.req.ticket
        read = source.plan.read
        if source.plan.staged_bytes != reply.nbytes:
            log.warning("request %r, source %s: it staged %d B, its layout has %d B; reading it directly",
                        t.request_id, source.address, reply.nbytes, source.plan.staged_bytes)
            self._fallback(track, source, "fallback_mismatch")
            return
        piece = self.pool.try_alloc(read.total_bytes)
        if piece is None:
            self._fallback(track, source, "fallback_pool_full")
            return
        n = read.num_ranges
        local = np.stack([piece.addr + read.local_offset, read.length, np.full(n, self._device_id)], axis=1)
        remote = np.stack([reply.addr + read.remote_offset, read.length, np.full(n, reply.device_id)], axis=1)
        if self._batched:
            self._ready.setdefault(source.peer, []).append((track, source, piece, reply, local, remote))
            return
        try:
            handle = self._agent.post_read(source.peer, local, remote)
        except EngineError as exc:
            self.pool.free(piece)
            track.error = track.error or exc
            return
        self.stats.staged_reads += 1
        self._posted(track, source, piece, reply, handle)

    def _posted(self, track: _Track, source: _Source, piece: StagingSlice, reply: wire.Staged, handle) -> None:
        source.piece, source.handle, source.gather_s = piece, handle, reply.gather_s
        source.read_posted_at = self._clock()
        log.debug("request %r source %d: %d ranges, waited %.3f ms, post %.3f ms", track.req.request_id,
                  source.plan.source_rank, source.plan.read.num_ranges, 1e3 * (source.answered_at - source.posted_at),
                  1e3 * (source.read_posted_at - source.answered_at))
        step_to(source, SourceStep.READING, track.req.request_id)
        self.stats.packed_sources += 1
        _add_handle(track.req, handle)

    def flush(self) -> None:
        """read_batching "per_step": post the staged READs made ready since the last flush, one READ per producer
        agent (each source holds a SharedRead of it). A source whose request ended meanwhile gives its slice
        back; a READ NIXL refuses fails each of its requests (``track.error``)."""
        ready, self._ready = self._ready, {}
        for peer, items in ready.items():
            live = []
            for item in items:
                if item[0].req.state is ReadState.READING:
                    live.append(item)
                else:
                    self.pool.free(item[2])
            if not live:
                continue
            try:
                handle = self._agent.post_read(peer, np.concatenate([i[4] for i in live]),
                                               np.concatenate([i[5] for i in live]))
            except EngineError as exc:
                for track, _, piece, *_ in live:
                    self.pool.free(piece)
                    track.error = track.error or exc
                continue
            self.stats.staged_reads += 1
            for track, source, piece, reply, local, _ in live:
                share = SharedRead(handle, int(local.shape[0]), int(local[:, 1].sum()))
                self._posted(track, source, piece, reply, share)

    def _fallback(self, track: _Track, source: _Source, counter: str) -> None:
        setattr(self.stats, counter, getattr(self.stats, counter) + 1)
        track.fallbacks += 1
        step_to(source, SourceStep.DIRECT, track.req.request_id)
        try:
            direct = source.plan.direct
            handle = self._agent.post_read(source.peer, direct.local_descs(), direct.remote_descs())
        except EngineError as exc:
            track.error = track.error or exc
            return
        _add_handle(track.req, handle)

    # ---- progress ---------------------------------------------------------------------
    def advance(self, req: Any) -> HybridTransferError | None:
        """Scatter sources whose READ is done, retire finished scatters; the error that fails the request, if any."""
        track = self._tracks.get(req.request_id)
        if track is None:
            return None
        if track.error is not None:
            return track.error
        if track.read_done_at is None and all(s.step is not SourceStep.WAITING for s in track.sources.values()) \
                and all(self._agent.check(h) is XferState.DONE for h in req.handles):
            track.read_done_at = self._clock()
        for source in track.sources.values():
            if source.step is SourceStep.READING and self._agent.check(source.handle) is XferState.DONE:
                read = source.plan.read
                log.debug("request %r source %d: READ of %d B seen done %.3f ms after its post", req.request_id,
                          source.plan.source_rank, read.total_bytes, 1e3 * (self._clock() - source.read_posted_at))
                try:
                    source.copy = self._copier.scatter(source.piece.tensor, read.scatter_dst, read.scatter_length)
                except HybridTransferError as exc:
                    track.error = exc
                    return exc
                step_to(source, SourceStep.SCATTERING, req.request_id)
            if source.step is SourceStep.SCATTERING and source.copy.is_done:
                track.scatter_s += source.copy.elapsed_s
                step_to(source, SourceStep.DONE, req.request_id)
        return None

    def has_staged(self, req: Any) -> bool:
        """Whether ``advance`` has more to do for the request than stamp when its READs are all done: staged
        sources to scatter, or an error to report (a direct request has neither)."""
        track = self._tracks.get(req.request_id)
        return track is not None and (bool(track.sources) or track.error is not None)

    def on_reads_done(self, req: Any) -> None:
        """A direct request's READs are all DONE (the caller checked them): stamp that time once (``read_s``)."""
        track = self._tracks.get(req.request_id)
        if track is not None and track.read_done_at is None:
            track.read_done_at = self._clock()

    def is_settled(self, req: Any) -> bool:
        """True when every staged source's bytes sit in their final place (direct ones are the consumer's)."""
        track = self._tracks.get(req.request_id)
        return track is None or all(s.step in SETTLED for s in track.sources.values())

    def result_fields(self, request_id: str) -> dict:
        """ReadResult's timing and pack fields of a request (zeros when it was never posted)."""
        track = self._tracks.get(request_id)
        if track is None:
            return {}
        done = track.read_done_at
        if not track.sources and not track.fallbacks and not track.unstaged:  # read directly: no pack fields
            return {"posted_at": track.posted_at, "read_s": (done - track.posted_at) if done is not None else 0.0,
                    "scatter_s": track.scatter_s}
        return {
            "posted_at": track.posted_at,
            "gather_s": max((s.gather_s for s in track.sources.values()), default=0.0),
            # From the post to the source's Staged notification (0 when it had arrived first), slowest source.
            "query_s": max((s.answered_at - s.posted_at for s in track.sources.values()
                            if s.answered_at is not None), default=0.0),
            "read_s": (done - track.posted_at) if done is not None else 0.0,
            "scatter_s": track.scatter_s,
            "num_packed_sources": sum(s.handle is not None for s in track.sources.values()),
            "num_fallback_sources": track.fallbacks,
            "unstaged_sources": tuple(sorted(track.unstaged)),
        }

    def forget(self, request_id: str) -> None:
        """The request is terminal (no handle can write its slices): wait for its scatters, free its slices."""
        track = self._tracks.pop(request_id, None)
        if track is None:
            return
        for source in track.sources.values():
            self._waiting.pop((source.peer, request_id), None)
            if source.copy is not None:
                source.copy.wait()
            if source.piece is not None:
                self.pool.free(source.piece)
                source.piece = None

    def close(self) -> None:
        for track in self._tracks.values():
            for source in track.sources.values():
                if source.copy is not None:
                    source.copy.wait()
        self._tracks.clear()
        self._waiting.clear()
        self._notes.clear()


def _add_handle(req: Any, handle: XferHandle) -> None:
    req.handles.append(handle)
    req.num_bytes += handle.num_bytes
    req.num_descriptors += handle.num_descriptors
