"""The decode side: read a ticket's blocks into local blocks, then tell every producer rank it is done.

Threads: the thread that builds a Consumer owns it and its NIXL agent; start_read,
poll, connect and close are called from that thread only. start_read never
waits on the network: a request for a producer engine not yet handshaked waits
in WAITING_PEER, and poll() plans and posts it once the handshake completes.
On CPU hosts UCX may copy the bytes inside the post itself (agent.py).
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import wire
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.peers import LinkState, Peers
from hybrid_transfer.engine.state import (
    TERMINAL,
    ReadRequest,
    ReadResult,
    ReadState,
    XferState,
    transition,
)
from hybrid_transfer.errors import (
    EngineError,
    HandshakeError,
    HandshakeTimeout,
    HybridTransferError,
    PlanError,
    ReadDeadlineError,
    RequestStateError,
    StatePositionError,
    TicketError,
    UnsupportedError,
)
from hybrid_transfer.layout.fingerprint import fingerprint_of
from hybrid_transfer.plan.rank import describe_rank
from hybrid_transfer.plan.types import ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import block_id_arrays, validate_block_ids

log = logging.getLogger(__name__)

_CONNECT_POLL_MS = 20


@dataclass
class ConsumerStats:
    done: int = 0
    failed: int = 0
    reads_posted: int = 0
    notifications_sent: int = 0
    notify_failures: int = 0  # data in place but a producer rank could not be told (its lease frees it)
    unexpected_notifications: int = 0  # nothing is sent to consumers yet (aborts will be, issue 5)


class Consumer:
    """One decode TP rank.

    Args:
        cache: this rank's cache (its geometry gives tp_rank and tp_size).
        config: engine settings (validated here).
        engine_id: the decode engine's name, for the producers' logs.
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(self, cache: HybridCache, config: EngineConfig | None = None, *, engine_id: str | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.config = (config or EngineConfig()).validate()
        self.cache = cache
        self.geometry = cache.geometry
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.tp_rank = self.geometry.tp_rank
        self._clock = clock
        self._kinds = tuple(g.kind for g in self.geometry.tensor_map.groups)
        self.agent = NixlAgent(f"{self.engine_id}-c{self.tp_rank}-{secrets.token_hex(4)}", self.config)
        self._closed = False
        self._peers: Peers | None = None
        try:
            self.agent.register(cache.regions)
            regions = cache.regions
            self.descriptor = describe_rank(self.geometry, [r.addr for r in regions], cache.num_blocks,
                                            device_id=regions[0].device_id, is_cuda=regions[0].is_cuda)
            self.fingerprint = fingerprint_of(self.geometry)
            self._digest = self.fingerprint.digest()
            self._peers = Peers(self.agent, self.geometry.model, self.descriptor, self.fingerprint, self.engine_id,
                                clock, self.config.handshake_timeout_s)
        except BaseException:
            self.close()
            raise
        self._requests: dict[str, ReadRequest] = {}
        self.stats = ConsumerStats()

    # ---- handshakes ---------------------------------------------------------------
    def connect(self, address: str, *, timeout_s: float | None = None) -> None:
        """Handshake now with the producer engine one of whose ranks listens at ``address``.

        Blocks until every rank of that engine has answered, or the timeout passes.

        Raises:
            HandshakeError: a refusal (``differences`` names each field with both values) or an
                engine this rank cannot read from; HandshakeTimeout when no answer came in time.
        """
        self._check_open()
        timeout_s = self.config.handshake_timeout_s if timeout_s is None else timeout_s
        deadline = self._clock() + timeout_s
        link = self._peers.connect(address)
        while True:
            link = link.resolve()
            if link.state is LinkState.READY:
                return
            if link.state is LinkState.FAILED:
                raise _again(link.error)
            if self._clock() >= deadline:
                raise HandshakeTimeout(address=address, timeout_s=timeout_s)
            self._peers.progress(timeout_ms=_CONNECT_POLL_MS)

    def connect_nowait(self, address: str) -> None:
        """Start a handshake with ``address``'s engine; poll() completes it."""
        self._check_open()
        self._peers.connect(address)

    # ---- requests -----------------------------------------------------------------
    def start_read(self, ticket: wire.Ticket, local_block_ids_per_group: Sequence[Sequence[int]], *,
                   expected_state_position: int | None = None) -> None:
        """Plan, validate and post one READ per source rank of ``ticket``; returns without waiting.

        Raises (nothing has moved when any of these is raised):
            StatePositionError: ``expected_state_position`` is given and the ticket's differs.
            TicketError: an inconsistent ticket.
            RequestStateError: this request id is already being read.
            PlanError (subclasses): local (or, when the engine is already linked, remote) block ids
                that do not fit the request.
            HandshakeError: the ticket's engine is known to be incompatible.
        """
        self._check_open()
        rid = ticket.request_id
        if expected_state_position is not None and ticket.state_position != expected_state_position:
            raise StatePositionError(request_id=rid, expected=expected_state_position, actual=ticket.state_position)
        if ticket.state_position != ticket.num_tokens or ticket.num_tokens < 0:
            raise TicketError(f"state position {ticket.state_position} must equal num_tokens {ticket.num_tokens}",
                              request_id=rid, state_position=ticket.state_position, num_tokens=ticket.num_tokens)
        if ticket.tp_size <= 0 or len(ticket.addresses) != ticket.tp_size:
            raise TicketError(f"lists {len(ticket.addresses)} addresses for TP {ticket.tp_size}", request_id=rid,
                              tp_size=ticket.tp_size, addresses=ticket.addresses)
        if rid in self._requests:
            raise RequestStateError("is already being read", request_id=rid, state=self._requests[rid].state.value)
        ids = block_id_arrays("local", local_block_ids_per_group, len(self._kinds))
        validate_block_ids("local", ids, self._kinds, ticket.num_tokens, self.geometry.block_size,
                           self.cache.num_blocks, exact=False)
        link = self._peers.ensure(ticket.engine_key, ticket.addresses)
        if link.state is LinkState.FAILED:
            raise _again(link.error)
        now = self._clock()
        req = ReadRequest(rid, ticket, tuple(tuple(int(b) for b in arr) for arr in ids), link, started_at=now,
                          deadline=now + self.config.read_deadline_s, changed_at=now)
        plan = self._plan(req) if link.state is LinkState.READY else None  # PlanError: nothing registered yet
        self._requests[rid] = req
        if plan is not None:
            self._post(req, plan, now)

    def poll(self) -> list[ReadResult]:
        """Progress handshakes and READs; return every request that reached DONE or FAILED."""
        self._check_open()
        self._peers.progress()
        # Also progresses NIXL (progress thread OFF): flushes our notifications, serves peers' wire-up.
        for messages in self.agent.get_notifs().values():
            self.stats.unexpected_notifications += len(messages)
        now = self._clock()
        results = []
        for req in list(self._requests.values()):
            self._advance(req, now)
            if req.state in TERMINAL:
                del self._requests[req.request_id]
                results.append(ReadResult(req.request_id, req.state, req.local_block_ids, req.num_bytes,
                                          req.num_descriptors, req.started_at, req.changed_at, req.error))
        return results

    def is_active(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_active(self) -> int:
        return len(self._requests)

    # ---- the lifecycle ----------------------------------------------------------------
    def _advance(self, req: ReadRequest, now: float) -> None:
        if req.state is ReadState.WAITING_PEER:
            link = req.link.resolve()
            if link.state is LinkState.READY:
                try:
                    plan = self._plan(req)
                except (PlanError, UnsupportedError) as exc:
                    self._fail(req, exc, now)
                else:
                    self._post(req, plan, now)
            elif link.state is LinkState.FAILED:
                self._fail(req, _again(link.error), now)
            elif now >= req.deadline:
                self._fail(req, self._deadline_error(req), now)
        elif req.state is ReadState.READING:
            states = [self.agent.check(h) for h in req.handles]
            if XferState.ERR in states:
                peers = [h.peer for h in req.handles if h.state is XferState.ERR]
                self._fail(req, EngineError("READ ended in error", operation="READ", agent=self.agent.name,
                                            peer=peers[0]), now)
            elif all(s is XferState.DONE for s in states):
                self._complete(req, now)
            elif now >= req.deadline:
                self._fail(req, self._deadline_error(req), now)
        elif req.state is ReadState.DRAINING:
            if all(self.agent.release(h) for h in req.handles):
                transition(req, ReadState.FAILED, now)
                self.stats.failed += 1

    def _plan(self, req: ReadRequest) -> ReadPlan:
        t = req.ticket
        planner = req.link.resolve().planner
        plan = planner.plan(req.local_block_ids, t.block_ids, t.num_tokens, self.config.mode)
        for src in plan.sources:
            if not isinstance(src, SourcePlan):
                raise UnsupportedError(f"plan mode {plan.mode.value}: pack execution is not implemented yet")
        return plan

    def _post(self, req: ReadRequest, plan: ReadPlan, now: float) -> None:
        transition(req, ReadState.READING, now)
        link = req.link.resolve()
        req.notify = tuple((n.source_rank, n.expected_consumers) for n in plan.notify)
        for src in plan.sources:
            try:
                handle = self.agent.post_read(link.agents[src.source_rank], src.local_descs(), src.remote_descs())
            except EngineError as exc:
                self._fail(req, exc, now)
                return
            req.handles.append(handle)
            req.num_bytes += handle.num_bytes
            req.num_descriptors += handle.num_descriptors
            self.stats.reads_posted += 1

    def _complete(self, req: ReadRequest, now: float) -> None:
        """Every READ is DONE: the bytes are in place. Only now tell the producer ranks."""
        link = req.link.resolve()
        t = req.ticket
        for source_rank, expected in req.notify:
            message = wire.encode(wire.Completion(request_id=t.request_id, nonce=t.nonce, consumer_rank=self.tp_rank,
                                                  expected_consumers=expected), self._digest)
            try:
                self.agent.send_notif(link.agents[source_rank], message)
                self.stats.notifications_sent += 1
            except EngineError as exc:
                self.stats.notify_failures += 1
                log.warning("consumer %s: %s", self.agent.name, exc)
        for handle in req.handles:
            self.agent.release(handle)
        transition(req, ReadState.DONE, now)
        self.stats.done += 1

    def _fail(self, req: ReadRequest, error: HybridTransferError, now: float) -> None:
        """Fail a request; it stays DRAINING while any posted READ may still write its blocks."""
        if req.error is None:
            req.error = error
        if all(self.agent.release(h) for h in req.handles):
            transition(req, ReadState.FAILED, now)
            self.stats.failed += 1
        elif req.state is not ReadState.DRAINING:
            transition(req, ReadState.DRAINING, now)

    def _deadline_error(self, req: ReadRequest) -> ReadDeadlineError:
        return ReadDeadlineError(request_id=req.request_id, deadline_s=self.config.read_deadline_s,
                                 state=req.state.value)

    # ---- teardown -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RequestStateError("the consumer is closed", request_id="*")

    def close(self) -> None:
        """Release every READ handle NIXL lets go of, stop handshakes, release NIXL; idempotent."""
        if self._closed:
            return
        self._closed = True
        for req in getattr(self, "_requests", {}).values():
            for handle in req.handles:
                self.agent.release(handle)
        if self._peers is not None:
            self._peers.close()
        self.agent.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _again(error: HandshakeError | None) -> HandshakeError:
    """A fresh exception carrying a link's stored failure (one stored instance, raised many times)."""
    if error is None:
        return HandshakeError("link failed")
    fresh = HandshakeError.__new__(type(error))
    fresh.__dict__.update(error.__dict__)
    fresh.args = error.args
    fresh.__cause__ = error
    return fresh
