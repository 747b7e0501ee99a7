"""Pack mode on the consumer: per source, a direct read or a staged one, as the plan says.

The plan (plan/planner.py) decides per source: a SourcePlan is read directly, a PackSourcePlan
through the source's staging (its read ranges and scatter pieces are the plan's; nothing is
mapped here). The producer side and the protocol are in stager.py. A staged source's steps
(steps.py, changed only through ``step_to``):

  QUERYING    a StagingQuery went to the source rank's side channel
  READING     READY came back: a slice of this rank's pool is taken and one READ of the plan's
              ranges (at most two) is posted into it
  SCATTERING  the READ is DONE: one index kernel copies the slice into the local blocks
  DONE        the scatter has finished (CUDA: its event completed)
  DIRECT      fallback: the plan's direct rows went out as one READ, because the source staged
              nothing (ABSENT: its pool was full), does not stage at all (an ErrorReply: a
              producer not in pack or auto mode), this rank's pool had no room (fallback, never a
              wait: see config.py), or the source's staged size disagreed with the plan's (a bug,
              logged as a warning)

Every fallback is counted (PackStats, ReadResult.num_fallback_sources). A producer rank that does
not stage is named once in the log (a warning) and in every ReadResult it serves
(``unstaged_sources``); later requests read from it directly without asking again. The consumer notifies
only once every source is DONE or DIRECT with its READ done, so completion follows the scatter.
Slices are freed in ``forget``, once the request is terminal (no handle can write them), after
waiting for any scatter still queued. Owned by the consumer's owner thread; it also keeps the
timings every request reports (post, READs done, gather and scatter times).
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
from hybrid_transfer.engine.agent import NixlAgent, XferHandle
from hybrid_transfer.engine.config import CostParams, EngineConfig
from hybrid_transfer.engine.pack.calibrate import calibrate, cost_model
from hybrid_transfer.engine.pack.gather_scatter import Arena, Copier, CopyTicket
from hybrid_transfer.engine.pack.stager import STAGING_MODES
from hybrid_transfer.engine.pack.staging import StagingPool, StagingSlice
from hybrid_transfer.engine.pack.steps import SETTLED, SourceStep, step_to
from hybrid_transfer.engine.side_channel import Curve, HandshakeClient
from hybrid_transfer.engine.state import ReadState, XferState
from hybrid_transfer.errors import EngineError, HybridTransferError, WireDecodeError
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode

log = logging.getLogger(__name__)


@dataclass
class PackStats:
    packed_sources: int = 0
    fallback_absent: int = 0  # the source staged nothing for this request (its pool was full)
    fallback_unstaged: int = 0  # the source does not stage at all (not in pack or auto mode)
    fallback_pool_full: int = 0  # this rank's pool had no room for the read
    fallback_mismatch: int = 0  # the source's staged size or layout disagreed with ours
    queries_sent: int = 0
    pending_replies: int = 0  # the source's gather was still running: asked again
    stray_replies: int = 0  # for requests no longer tracked


@dataclass(eq=False)
class _Source:
    plan: PackSourcePlan  # the planner's: read ranges of the source's staging, scatter pieces, direct rows
    address: str
    peer: str
    step: SourceStep = SourceStep.QUERYING
    piece: StagingSlice | None = None
    handle: XferHandle | None = None
    copy: CopyTicket | None = None
    gather_s: float = 0.0
    asked_at: float | None = None  # first StagingQuery
    answered_at: float | None = None  # READY / ABSENT taken in (PENDING asks again)
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
                 clock: Callable[[], float], *, curve: Curve | None = None):
        self._agent = agent
        self._clock = clock  # read afresh after copies: on CPU a READ or a scatter runs inside the call
        self._rank = cache.geometry.tp_rank
        self._config = config
        self._digest = digest
        self.enabled = config.mode in STAGING_MODES
        self.stats = PackStats()
        self.cost = cost_model(config.cost or CostParams())
        self.pool: StagingPool | None = None
        self._tracks: dict[str, _Track] = {}
        self._asked: dict[str, collections.deque] = {}  # address -> (request id, source rank), in send order
        self._unstaged: dict[tuple, str] = {}  # (engine key, source rank) -> why that rank does not stage for us
        self._client: HandshakeClient | None = None
        if not self.enabled:
            return
        self.pool = StagingPool(config.staging_bytes, cache.device)
        agent.register_more([self.pool.region])
        self._device_id = self.pool.region.device_id
        self._copier = Copier(Arena(cache.tensors))
        self._client = HandshakeClient(curve)  # CURVE when the side channel is encrypted
        if config.mode is PlanMode.AUTO and config.cost is None and config.calibrate:
            self.cost = cost_model(calibrate(agent, self.pool, self._copier))

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
        source = _Source(src, req.ticket.addresses[src.source_rank], link.agents[src.source_rank])
        track = self._tracks[req.request_id]
        track.sources[src.source_rank] = source
        if (req.ticket.engine_key, src.source_rank) in self._unstaged:  # said so once already: no query
            track.unstaged.append(src.source_rank)
            self._fallback(track, source, "fallback_unstaged")
            return
        self._ask(req, source)

    def _ask(self, req: Any, source: _Source) -> None:
        t = req.ticket
        query = wire.StagingQuery(request_id=t.request_id, nonce=t.nonce, consumer_rank=self._rank)
        self._client.send(source.address, wire.encode(query, self._digest))
        if source.asked_at is None:
            source.asked_at = self._clock()
        self._asked.setdefault(source.address, collections.deque()).append((t.request_id, source.plan.source_rank))
        self.stats.queries_sent += 1

    # ---- replies ----------------------------------------------------------------------
    def receive(self) -> None:
        """Take in every staging reply that has arrived and act on it (post a READ, or fall back)."""
        if self._client is None:
            return
        for address, data in self._client.receive(0):
            asked = self._asked.get(address)
            try:
                body = wire.decode(data)[1]
            except WireDecodeError:
                body = None
            key = None
            if asked:
                if isinstance(body, wire.StagingReply):
                    key = next((k for k in asked if k[0] == body.request_id), None)
                    if key is not None:
                        asked.remove(key)
                else:  # an ErrorReply names no request: replies come back in the order asked
                    key = asked.popleft()
            track = self._tracks.get(key[0]) if key else None
            source = track.sources.get(key[1]) if track else None
            if source is None or source.step is not SourceStep.QUERYING:
                self.stats.stray_replies += 1
                continue
            if track.req.state is not ReadState.READING:
                # The request is ending (failed, aborted, revoked): posting now would only add a handle
                # its quarantine must wait for.
                self.stats.stray_replies += 1
                continue
            self._on_reply(track, source, body)

    def _on_reply(self, track: _Track, source: _Source, body: Any) -> None:
        status = body.status if isinstance(body, wire.StagingReply) else None
        if status is wire.StagingStatus.PENDING:
            self.stats.pending_replies += 1
            self._ask(track.req, source)
            return
        source.answered_at = self._clock()
        if status is wire.StagingStatus.READY:
            self._post_staged(track, source, body)
        elif isinstance(body, wire.ErrorReply):  # a producer without a stager cannot read the query
            self._note_unstaged(track, source, body.reason)
            self._fallback(track, source, "fallback_unstaged")
        else:
            self._fallback(track, source, "fallback_absent")

    def _note_unstaged(self, track: _Track, source: _Source, reason: str) -> None:
        key = (track.req.ticket.engine_key, source.plan.source_rank)
        if key not in self._unstaged:
            self._unstaged[key] = reason
            log.warning("producer engine %s rank %d at %s does not stage (its mode is not pack or auto; it "
                        "answered: %s): this %s consumer reads from it directly", key[0][0],
                        source.plan.source_rank, source.address, reason, self._config.mode.value)
        track.unstaged.append(source.plan.source_rank)

    def _post_staged(self, track: _Track, source: _Source, reply: wire.StagingReply) -> None:
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
        try:
            handle = self._agent.post_read(source.peer, local, remote)
        except EngineError as exc:
            self.pool.free(piece)
            track.error = track.error or exc
            return
        source.piece, source.handle, source.gather_s = piece, handle, reply.gather_s
        source.read_posted_at = self._clock()
        log.debug("request %r source %d: %d ranges, query %.3f ms, post %.3f ms", t.request_id,
                  source.plan.source_rank, n, 1e3 * (source.answered_at - source.asked_at),
                  1e3 * (source.read_posted_at - source.answered_at))
        step_to(source, SourceStep.READING, t.request_id)
        self.stats.packed_sources += 1
        _add_handle(track.req, handle)

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
        if track.read_done_at is None and all(s.step is not SourceStep.QUERYING for s in track.sources.values()) \
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
        return {
            "posted_at": track.posted_at,
            "gather_s": max((s.gather_s for s in track.sources.values()), default=0.0),
            "query_s": max((s.answered_at - s.asked_at for s in track.sources.values()
                            if s.answered_at is not None and s.asked_at is not None), default=0.0),
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
        if self._client is not None:
            self._client.close()
            self._client = None


def _add_handle(req: Any, handle: XferHandle) -> None:
    req.handles.append(handle)
    req.num_bytes += handle.num_bytes
    req.num_descriptors += handle.num_descriptors
