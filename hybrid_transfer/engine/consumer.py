"""The decode side: read a ticket's blocks into local blocks, then tell every producer rank it is done.

Threads: the thread that builds a Consumer owns it and its NIXL agent; start_read,
poll, connect and close are called from that thread only. start_read never
waits on the network: a request for a producer engine not yet handshaked waits
in WAITING_PEER, and poll() plans and posts it once the handshake completes.
On CPU hosts UCX may copy the bytes inside the post itself (agent.py).

start_reads takes every request of an engine step at once: each is admitted as start_read admits it,
and with ``read_batching="per_step"`` they post one READ and one Claims per producer agent, their
completions one Completions per producer agent per call (read_batch.py, docs/lifecycle.md#batched-reads).

Lifecycle under faults (issue 5): after the handshake this rank says Hello to each producer
agent (its metadata, so the producer can notify it) and READs from it only after its Welcome,
which lists the tickets it revoked; a later Revoke fails the request (never DONE) and is
acknowledged at once. Heartbeats renew the leases of waiting and reading requests. A failed or
aborted request's blocks go to the quarantine (lifecycle/quarantine.py) and the request is reported only
once no handle and no unfinished engine step can write them; its producer ranks are told at
once, so they free early. NIXL reporting a producer agent disconnected fails its requests.

With a shared secret (issue 14, engine/auth.py) every notification both ways is sealed under the
link key agreed at the handshake; one from a producer agent that fails the check is counted in
``rejections`` and dropped. What this rank knows of each producer agent is one record
(peer_record.py) in ``Peers.records``.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import auth, claims, inputs, metrics, read_batch, wire
from hybrid_transfer.engine.addresses import AllowedProducers
from hybrid_transfer.engine.agent import NixlAgent, SharedRead, XferState
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.consumer_notes import ProducerNotes
from hybrid_transfer.engine.declines import MAX_PENDING_DECLINES, Declines
from hybrid_transfer.engine.inbox import Inbox
from hybrid_transfer.engine.lifecycle.fences import StepFences
from hybrid_transfer.engine.lifecycle.quarantine import Quarantine
from hybrid_transfer.engine.lifecycle.revocations import Tombstones
from hybrid_transfer.engine.lifecycle.state import (
    ENDING,
    TERMINAL,
    FailureCause,
    ReadRequest,
    ReadResult,
    ReadState,
    transition,
)
from hybrid_transfer.engine.log_gate import LogGate
from hybrid_transfer.engine.mapped import ReadTransports
from hybrid_transfer.engine.pack.reader import PackReader
from hybrid_transfer.engine.peer_record import PeerStage, consumer_agent_name
from hybrid_transfer.engine.peers import EngineLink, LinkState, LinkStats, Peers
from hybrid_transfer.errors import (
    BlockBusyError,
    ByteCountError,
    EngineError,
    HandshakeError,
    HandshakeTimeout,
    HybridTransferError,
    PeerDisconnectedError,
    PlanError,
    ProducerNotAllowedError,
    ReadDeadlineError,
    RequestAbortedError,
    RequestStateError,
    SourceLostError,
    StatePositionError,
    TicketClaimError,
    TicketError,
    TicketRevokedError,
    UnsupportedError,
)
from hybrid_transfer.layout.fingerprint import fingerprint_of
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.types import ReadPlan
from hybrid_transfer.plan.validate import ExpectedBytes, block_id_arrays, check_first_token, validate_block_ids
from hybrid_transfer.planner_input import describe_cache

log = logging.getLogger(__name__)

_CONNECT_POLL_MS = 20
_LIVE = (ReadState.WAITING_PEER, ReadState.READING)


@dataclass
class ConsumerStats:
    done: int = 0
    failed: int = 0
    aborted: int = 0
    reads_posted: int = 0
    notifications_sent: int = 0
    notify_failures: int = 0  # a producer rank could not be told (its lease frees the blocks)
    heartbeats_sent: int = 0  # messages: one per producer agent per interval, listing every request
    heartbeat_failures: int = 0
    hellos_sent: int = 0
    welcomes: int = 0
    revokes: int = 0  # Revoke messages taken in (each acknowledged)
    unexpected_notifications: int = 0  # not a Welcome or Revoke of ours from a producer agent we greeted
    declines_sent: int = 0  # tickets declined: their producer ranks were told (ABORTED completions)
    declines_dropped: int = 0  # declines whose engine could not be linked in time (its lease frees them)
    notifications_dropped: int = 0  # arrived while the backlog of unhandled notifications was full
    rejected: int = 0  # notifications that failed authentication (by cause: Consumer.rejections)
    claims_sent: int = 0  # one per source agent per request read (claims.py)
    claims_confirmed: int = 0
    claims_refused: int = 0  # ... each fails its request (ticket_replayed, ticket_edited or revoked)


class Consumer(ProducerNotes):
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
        self.engine_id = inputs.engine_id(engine_id) if engine_id is not None else uuid.uuid4().hex[:12]
        self.tp_rank = self.geometry.tp_rank
        self._clock = clock
        self._kinds = tuple(g.kind for g in self.geometry.tensor_map.groups)
        on_gpu = cache.device.type == "cuda"
        self._expected_bytes = ExpectedBytes(self.geometry)  # checked against every DONE request's bytes
        self.agent = NixlAgent(consumer_agent_name(self.engine_id, self.tp_rank, secrets.token_hex(4)), self.config,
                               device_memory=on_gpu, post_thread=self.config.uses_post_thread(on_gpu),
                               thread_init=_device_setter(cache.device) if on_gpu else None)
        if on_gpu and self.agent.has_post_thread:  # docs/tuning.md#posting-thread: measured, not guessed
            log.warning("consumer %s: post_thread on GPU caches moved 0.01 of the single-READ ceiling on an H200 "
                        "(docs/tuning.md#posting-thread); leave it off unless measured here", self.agent.name)
        self._closed = False
        self._peers: Peers | None = None
        self._pack: PackReader | None = None
        self.reads: ReadTransports | None = None
        try:
            self.agent.register(cache.regions)
            # Every READ goes through this seam: over NIXL, or over a mapping of the producer's cache (engine/mapped/).
            self.reads = ReadTransports(self.agent, cache, self.config.read_transport)
            self.descriptor = describe_cache(cache)
            self.fingerprint = fingerprint_of(self.geometry)
            self._digest = self.fingerprint.digest()
            self._secret = auth.load_secret(self.config.secret_file)
            auth.warn_if_open(self._secret, f"consumer {self.agent.name}")
            curve = auth.side_channel_curve(self.config.side_channel_curve, self._secret)
            self._peers = Peers(self.agent, self.geometry.model, self.descriptor, self.fingerprint, self.engine_id,
                                clock, self.config.handshake_timeout_s, self._secret, curve=curve,
                                allowed=AllowedProducers(self.config.allowed_producers),
                                max_links=self.config.max_links, max_sockets=self.config.max_handshake_sockets,
                                reads=self.reads, read_transport=self.config.read_transport)
            # Pack mode (staging reads, engine/pack/reader.py) and every request's timings.
            self._pack = PackReader(self.agent, cache, self.config, self._digest, clock, reads=self.reads)
        except BaseException:
            self.close()
            raise
        self._metadata = self.agent.metadata  # sent in each Hello (connection info: producers only notify us)
        self._requests: dict[str, ReadRequest] = {}
        self.stats = ConsumerStats()
        self._recorder = metrics.ConsumerRecorder()  # bytes, descriptors, latency of DONE requests
        self.failure_causes: Counter[str] = Counter()  # FailureCause value -> requests reported FAILED with it
        self.fences = StepFences()
        self._quarantine = Quarantine(self.fences)
        # Local blocks some not yet reported request writes (its written_block_ids): one owner each, as
        # _register refuses a block already here; a request's leave this set when it is reported.
        self._owned: set[int] = set()
        self._tombstones = Tombstones()
        self._records = self._peers.records  # producer agent -> its one record (stage, link, error when GONE)
        self._log = LogGate(log, self._clock)  # repeated warnings: one line per cause per interval
        self.rejections = auth.RejectionLog(f"consumer {self.agent.name}", self._log)  # .counts: cause -> dropped
        self._next_heartbeat_at = clock()
        # At most notifications_per_poll handled per poll (inbox.py). A Revoke may wait in the backlog, so
        # no READ is judged DONE while one is left (see _advance).
        self._inbox = Inbox(self.config.notifications_per_poll, self.config.notification_backlog_bytes)
        self._leftovers = 0  # quarantine entries of DONE handles NIXL did not let go of at once
        self._declines = Declines(self.agent.name)  # tickets declined, waiting for their engine's link
        self._unloaded: list[str] = []  # producer agents of dropped links, removed from NIXL at the next poll
        self._peers.in_use = self._links_in_use  # an idle link may be evicted (max_links), a busy one never
        self._peers.on_drop = self._drop_link
        self._batched = self.config.read_batching == "per_step"  # docs/lifecycle.md#batched-reads
        self._outbox = read_batch.Outbox()  # per_step: completions leave as one Completions per agent per call
        self._ready: list = []  # per_step: (request, plan) linked during this poll, posted together at its end
        # A post on GPU caches only queues the copy (a kernel, or UCX's cuda_ipc): a step's claims may follow it.
        self._posts_queue_copies = on_gpu

    @property
    def cost_model(self) -> CostModel:
        """The cost model this rank plans ``auto`` with (its memory's preset unless the config gives or calibrates one)."""
        return self._pack.cost

    # ---- handshakes ---------------------------------------------------------------
    def connect(self, address: str, *, timeout_s: float | None = None) -> None:
        """Handshake now with the producer engine one of whose ranks listens at ``address``.

        Blocks until every rank of that engine has answered, or the timeout passes.

        Raises:
            HandshakeError: a refusal (``differences`` names each field with both values, ``cause`` the
                producer's word) or an engine this rank cannot read from; an address that is malformed or
                not in ``allowed_producers`` (cause "unreachable" / "disallowed", nothing connected);
                HandshakeTimeout when no answer came in time.
        """
        self._check_open()
        timeout_s = self.config.handshake_timeout_s if timeout_s is None else timeout_s
        deadline = self._clock() + timeout_s
        link = self._peers.connect(address)
        while True:
            link = link.resolve()
            if link.state is LinkState.READY:
                self._greet(link)  # the Welcome arrives with a later poll(); reads wait for it
                return
            if link.state is LinkState.FAILED:
                raise self._peers.error_of(link)
            if self._clock() >= deadline:
                raise HandshakeTimeout(address=address, timeout_s=timeout_s)
            self._peers.progress(timeout_ms=_CONNECT_POLL_MS)

    def connect_nowait(self, address: str) -> None:
        """Start a handshake with ``address``'s engine; poll() completes it."""
        self._check_open()
        self._peers.connect(address)

    # ---- requests -----------------------------------------------------------------
    def start_reads(self, reads: Sequence[read_batch.Read]) -> list[Exception | None]:
        """Start every request of a step at once (docs/lifecycle.md#batched-reads); returns without waiting.

        Each ``Read`` (ticket, local block ids per group, expected state position) is checked and planned
        exactly as ``start_read`` does; one that is refused fails alone and its error (start_read's typed
        ones; an untyped one, a ZeroMQ error say, likewise) is returned in its place (None: accepted), so a
        bad request never stops the others. With ``read_batching`` "per_step"
        the accepted ones then post one READ and one Claims per producer agent; "per_request" posts each
        request as ``start_read`` does.
        """
        self._check_open()
        errors: list[Exception | None] = [None] * len(reads)
        checked = []
        for i, read in enumerate(reads):
            try:
                checked.append((i, self._check(*read)))
            except Exception as exc:  # noqa: BLE001 - it stays with its request (docstring)
                errors[i] = exc
        plans = read_batch.plan_step(self, checked)
        ready = []
        for i, c in checked:
            try:
                item = self._register(c, plans.get(i))
            except Exception as exc:  # noqa: BLE001 - as above
                errors[i] = exc
                continue
            if item is not None:
                ready.append(item)
        self._post_all(ready, self._clock())
        self._flush()
        return errors

    def start_read(self, ticket: wire.Ticket, local_block_ids_per_group: Sequence[Sequence[int]], *,
                   expected_state_position: int | None = None, first_token: int = 0) -> None:
        """Plan, validate and post one READ per source rank of ``ticket``; returns without waiting.

        ``first_token``: this rank already holds tokens [0, first_token) in the first blocks of each
        attention list (a local prefix hit, on a local block boundary): only the tokens past it and the
        state are read, and the hit's blocks are neither owned nor written (docs/planner.md#prefix-hits).
        The lists still cover the whole request.

        Checked before any socket, connect or pin: every field of the ticket (engine/inputs.py), its
        addresses against ``EngineConfig.allowed_producers``, and its MAC (an edited ticket is
        reported FAILED, cause ``ticket_edited``, without connecting anywhere).

        Raises (nothing has moved and nothing was connected when any of these is raised):
            StatePositionError: ``expected_state_position`` is given and the ticket's differs.
            TicketError: an inconsistent ticket, a field that could not travel in one (a bool for an
                int, a nonce outside [0, 2**63), ...) or beyond a cap, named with its value; addresses
                other than those of the engine's existing link.
            ProducerNotAllowedError: an address ``allowed_producers`` does not list.
            ConfigError: ``expected_state_position`` is not a non-negative int.
            RequestStateError: this request id is already being read.
            PlanError (subclasses): local (or, when the engine is already linked, remote) block ids
                that do not fit the request.
            HandshakeError: the ticket's engine link failed and backs off (``cause`` names why: the
                producer's refusal cause, "timeout", ...), or a bound on links or handshakes is reached.
            BlockBusyError: a local block still belongs to a request not reported yet (reading, or
                quarantined until nothing can write it).
        """
        self._check_open()
        item = self._admit(ticket, local_block_ids_per_group, expected_state_position, first_token)
        if item is not None:
            self._post(*item, self._clock())
        self._flush()

    def _admit(self, ticket: wire.Ticket, local_block_ids_per_group: Sequence[Sequence[int]],
               expected_state_position: int | None = None, first_token: int = 0) -> tuple | None:
        """start_read's checks and bookkeeping; (request, plan) when it can be posted now (raises as start_read)."""
        c = self._check(ticket, local_block_ids_per_group, expected_state_position, first_token)
        return self._register(c, self._plan(c.ticket, c.ids, c.known, c.first_token) if c.ready else None)

    def _check(self, ticket: wire.Ticket, local_block_ids_per_group: Sequence[Sequence[int]],
               expected_state_position: int | None = None, first_token: int = 0) -> read_batch.Checked:
        """A request's own checks, before anything is registered or planned (raises as start_read)."""
        self._check_open()
        ticket = inputs.ticket(ticket)  # every field's type, range, size and address syntax (engine/inputs.py)
        if expected_state_position is not None:
            expected_state_position = inputs.count("expected_state_position", expected_state_position)
        proven = inputs.block_id_lists("local", local_block_ids_per_group)
        first_token = inputs.count("first_token", first_token)
        rid = ticket.request_id
        if expected_state_position is not None and ticket.state_position != expected_state_position:
            raise StatePositionError(request_id=rid, expected=expected_state_position, actual=ticket.state_position)
        if ticket.state_position != ticket.num_tokens:
            raise TicketError(f"state position {ticket.state_position} must equal num_tokens {ticket.num_tokens}",
                              request_id=rid, state_position=ticket.state_position, num_tokens=ticket.num_tokens)
        check_first_token(first_token, ticket.num_tokens, self.geometry.block_size)  # before any connect
        self._check_addresses(ticket)
        if rid in self._requests:
            raise RequestStateError("is already being read", request_id=rid, state=self._requests[rid].state.value)
        # The proven copy of the usual lists, kept as tuples (the request's own, and what the planner reads);
        # anything else (arrays, a wrong group count) converts here, which raises what a bad one gets.
        ids = proven if proven and len(proven) == len(self._kinds) else tuple(
            tuple(arr.tolist()) for arr in block_id_arrays("local", local_block_ids_per_group, len(self._kinds)))
        # The MAC before any connect (docs/security.md#allowed-producers): an edited ticket never makes this
        # rank handshake with the addresses it names, so it cannot poison the link of the engine it names.
        digest = claims.digest_of(ticket)
        signed = claims.mac_ok(ticket, self._secret, digest)
        known = self._peers.find(ticket.engine_key) if signed else None
        ready = known is not None and known.state is LinkState.READY and known.addresses == ticket.addresses
        if not ready:  # a ready link's planner validates both sides: each id is checked once
            validate_block_ids("local", block_id_arrays("local", ids, len(self._kinds)), self._kinds,
                               ticket.num_tokens, self.geometry.block_size, self.cache.num_blocks, exact=False)
        return read_batch.Checked(ticket, ids, signed, known, ready, digest, first_token)

    def _register(self, c: read_batch.Checked, plan: ReadPlan | Exception | None) -> tuple | None:
        """Own the request's blocks and track it; (request, plan) when it can be posted now.

        Raises: RequestStateError, BlockBusyError, HandshakeError, or the request's plan error (as start_read)."""
        ticket, rid = c.ticket, c.ticket.request_id
        if rid in self._requests:  # listed twice in one step
            raise RequestStateError("is already being read", request_id=rid, state=self._requests[rid].state.value)
        local = c.ids
        hit_blocks = c.first_token // self.geometry.block_size
        written = tuple(ids[hit_blocks:] if kind is LayerKind.ATTENTION else ids
                        for kind, ids in zip(self._kinds, local, strict=True)) if hit_blocks else local
        owned = self._owned
        if not owned.isdisjoint(chain.from_iterable(written)):
            busy = [b for group in written for b in group if b in owned]
            raise BlockBusyError(request_id=rid, block_ids=busy, owners=[self._owner_of(b) for b in busy])
        now = self._clock()
        link = self._link_for(ticket) if c.signed else EngineLink(ticket.engine_key, ticket.addresses, now,
                                                                   LinkState.FAILED, cause="mac")
        if isinstance(plan, Exception):
            raise plan  # PlanError: nothing registered yet
        req = ReadRequest(rid, ticket, local, link, started_at=now, deadline=now + self.config.read_deadline_s,
                          changed_at=now, digest=c.digest,  # the MAC check's
                          first_token=c.first_token, written_block_ids=written)
        self._requests[rid] = req
        owned.update(*written)
        if (rid, ticket.nonce) in self._tombstones:
            self._end(req, TicketRevokedError(request_id=rid, nonce=ticket.nonce), now, FailureCause.REVOKED)
        elif not c.signed:  # edited, or not signed under our secret: read nothing, connect nowhere
            req.disowned = True
            self.stats.claims_refused += 1
            self._end(req, TicketClaimError(request_id=rid, nonce=ticket.nonce, status="edited (its MAC does not "
                                            "match its fields)", agent="(checked locally)"), now,
                      FailureCause.TICKET_EDITED)
        elif plan is not None and self._greet(link) and self._lost_agent(link) is None:
            return req, plan
        return None

    def _post_all(self, ready: list, now: float) -> None:
        """Post admitted requests: in one pass (read_batch.py) with per_step batching, else one by one."""
        if self._batched:
            read_batch.post_step(self, ready, now)
        else:
            for req, plan in ready:
                self._post(req, plan, now)

    def poll(self) -> list[ReadResult]:
        """Progress handshakes, notifications and READs; return every request that ended.

        DONE as soon as the bytes are in place; FAILED and ABORTED only once their blocks have
        left the quarantine (no handle and no unfinished step can write them).
        """
        self._check_open()
        self._peers.progress()
        # Also progresses NIXL (progress thread OFF): flushes our notifications, serves peers' wire-up.
        # Revocations are taken in before any READ is judged DONE (see the module docstring).
        self._take_notifications()
        self._unload()
        self._log.flush()
        self._pack.expire_waits()  # pack: sources whose Staged notification never came read directly
        now = self._clock()
        self._tombstones.prune(now)
        with self.agent.one_check_per_handle():  # pack's and this loop's checks share one NIXL query a poll
            for req in list(self._requests.values()):
                self._advance(req, now)
            ready, self._ready = self._ready, []
            self._post_all(ready, now)
            self._advance_declines(now)
            self._heartbeat(now)
            results = self._collect(now)
        self._flush()
        return results

    def _flush(self) -> None:
        """per_step: post the staged READs made ready in this call (one per producer agent), then send its
        completions, one Completions per producer agent."""
        self._pack.flush()
        sent, failed = self._outbox.flush(self._send_body, self.tp_rank)
        self.stats.notifications_sent += sent
        self.stats.notify_failures += failed

    def abort(self, request_id: str) -> bool:
        """The embedder gives up on a request; False when it is unknown or already ending.

        The producer ranks are told at once (they free early). The local blocks stay quarantined
        until every READ handle is released and their step fences have passed; poll() then
        reports the request ABORTED.
        """
        self._check_open()
        req = self._requests.get(request_id)
        if req is None or req.state not in _LIVE:
            return False
        self._end(req, RequestAbortedError(request_id=request_id, state=req.state.value), self._clock())
        self._flush()
        return True

    def decline(self, ticket: wire.Ticket) -> bool:
        """Tell the producer ranks this rank depends on that it will not read ``ticket``'s blocks.

        For requests the embedder drops before their read (aborted before scheduling, or a full
        local hit): each producer rank this rank would have read from (or notified) gets an
        ABORTED completion and frees once every expected consumer rank has reported, instead of
        at lease expiry. Every consumer rank of the engine declines, as every one would have read.
        Returns at once: a producer engine not handshaked yet is connected first, and poll()
        sends the completions once the link is ready. Nothing is reported by poll() for a decline.
        Returns False when the ticket is already being declined or its engine is known to be
        unreachable or incompatible (its lease then frees the blocks).

        Checked before connecting anywhere: the ticket's fields, its addresses against
        ``allowed_producers`` and its MAC.

        Raises:
            TicketError: an ill-formed ticket, addresses that do not match its TP size, a MAC that does
                not match its fields (``field`` "mac"); ProducerNotAllowedError for an address not allowed.
            RequestStateError: this rank is reading the request (use ``abort``).
        """
        self._check_open()
        ticket = inputs.ticket(ticket)
        rid = ticket.request_id
        self._check_addresses(ticket)
        if rid in self._requests:
            raise RequestStateError("is being read here: abort() it instead of declining",
                                    request_id=rid, state=self._requests[rid].state.value)
        if not claims.mac_ok(ticket, self._secret):  # checked before connecting anywhere
            raise TicketError("its MAC does not match its fields (edited, or not signed under our secret): not "
                              "declining it", request_id=rid, field="mac")
        if (rid, ticket.nonce) in self._declines:
            return False
        if len(self._declines) >= MAX_PENDING_DECLINES:
            self.stats.declines_dropped += 1
            self._log.warning("decline dropped", "consumer %s: %d declines wait for links; %r dropped (its lease "
                              "frees it)", self.agent.name, len(self._declines), rid)
            return False
        try:
            link = self._link_for(ticket)
        except HandshakeError as exc:
            self.stats.declines_dropped += 1
            log.info("consumer %s: cannot decline %r, its engine is unusable: %s", self.agent.name, rid, exc)
            return False
        now = self._clock()
        self._declines.add(ticket, link, now + self.config.handshake_timeout_s)
        self._advance_declines(now)
        self._flush()
        return True

    def _check_addresses(self, ticket: wire.Ticket) -> None:
        """As many addresses as ranks, each one this rank may connect to (EngineConfig.allowed_producers)."""
        if len(ticket.addresses) != ticket.tp_size:
            raise TicketError(f"lists {len(ticket.addresses)} addresses for TP {ticket.tp_size}",
                              request_id=ticket.request_id, tp_size=ticket.tp_size, addresses=ticket.addresses)
        for address in ticket.addresses:
            if not self._peers.allows(address):
                raise ProducerNotAllowedError(request_id=ticket.request_id, address=address)

    def _link_for(self, ticket: wire.Ticket) -> EngineLink:
        """The live link of a checked ticket's engine (starting its handshakes if need be).

        Raises:
            HandshakeError: the engine's link failed and backs off (naming the cause), or a bound is reached.
            TicketError: an existing link of that engine has other addresses (the ticket's fail alone).
        """
        link = self._peers.ensure(ticket.engine_key, ticket.addresses)
        if link.state is LinkState.FAILED:
            raise self._peers.error_of(link)
        if link.addresses != ticket.addresses:
            raise TicketError(f"names addresses {list(ticket.addresses)}, but engine {ticket.engine_key} is linked "
                              f"at {list(link.addresses)}", request_id=ticket.request_id, field="addresses")
        return link

    @property
    def num_links(self) -> int:
        """Producer engines this rank holds a link to (live, handshaking or failed and backing off)."""
        return self._peers.num_links

    @property
    def num_handshake_sockets(self) -> int:
        """Side-channel sockets open now: one per producer rank address whose handshake is in flight."""
        return self._peers.num_sockets

    @property
    def link_stats(self) -> LinkStats:
        """Link failures, retries after a backoff, evictions and expiries since start (engine/peers.py)."""
        return self._peers.stats

    @property
    def num_pending_declines(self) -> int:
        """Declines whose producer engine is still being handshaked."""
        return len(self._declines)

    def _advance_declines(self, now: float) -> None:
        sent, dropped = self._declines.advance(now, lambda t, link: self._notify_producers(
            t, link, tuple((n.source_rank, n.expected_consumers) for n in link.planner.notify),
            wire.CompletionKind.ABORTED))
        self.stats.declines_sent += sent
        self.stats.declines_dropped += dropped

    def mark_blocks_written(self, block_ids: Sequence[int], step: int) -> None:
        """Engine step ``step`` writes these local blocks: a failed or aborted request keeps them until it finished."""
        self.fences.mark(block_ids, step)

    def finish_step(self, step: int) -> None:
        """Every engine step up to ``step`` has finished on the device."""
        self.fences.finish(step)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_active(self) -> int:
        return len(self._requests)

    @property
    def num_peer_records(self) -> int:
        """Producer agents this rank keeps a PeerRecord of: at most those of the links it holds."""
        return len(self._records)

    @property
    def num_live_handles(self) -> int:
        """READ handles (NIXL's and mapped ones) that could still write."""
        return self.reads.num_live_handles

    def link_transports(self) -> dict[str, str]:
        """Producer agent -> the transport its READs take ("nixl", "shm", "cuda_ipc"), for every agent linked."""
        return {agent: link.transports.get(rank, "nixl") for link in self._peers.links()
                for rank, agent in link.agents.items()}

    @property
    def num_quarantined_blocks(self) -> int:
        """Local blocks of failed or aborted requests that something may still write."""
        return self._quarantine.num_blocks

    @property
    def terminal_counts(self) -> dict[str, int]:
        """Requests reported, by terminal state."""
        return {"done": self.stats.done, "failed": self.stats.failed, "aborted": self.stats.aborted}

    def metrics(self) -> metrics.ConsumerMetrics:
        """A snapshot of this rank's counters, bytes and post-to-DONE latency (engine/metrics.py)."""
        return metrics.consumer_metrics(self)

    # ---- the lifecycle ----------------------------------------------------------------
    def _advance(self, req: ReadRequest, now: float) -> None:
        if req.state is ReadState.WAITING_PEER:
            link = req.link.resolve()
            if link.state is LinkState.READY:
                lost = self._lost_agent(link)
                if lost is not None:
                    self._end(req, SourceLostError(request_id=req.request_id, agent=lost,
                                                   detail=str(self._records[lost].error)), now, FailureCause.SOURCE_LOST)
                elif self._greet(link):
                    try:
                        plan = self._plan(req.ticket, req.local_block_ids, req.link, req.first_token)
                    except (PlanError, UnsupportedError) as exc:
                        self._end(req, exc, now, FailureCause.PLAN)
                    else:
                        if self._batched:
                            self._ready.append((req, plan))  # posted with the others at the end of this poll
                        else:
                            self._post(req, plan, now)
                elif now >= req.deadline:
                    self._end(req, self._deadline_error(req), now, FailureCause.DEADLINE)
            elif link.state is LinkState.FAILED:
                self._end(req, self._peers.error_of(link), now, FailureCause.HANDSHAKE)
            elif now >= req.deadline:
                self._end(req, self._deadline_error(req), now, FailureCause.DEADLINE)
        elif req.state is ReadState.READING:
            pack, check = self._pack, self.reads.check
            staged = pack.has_staged(req)
            if staged:
                pack_error = pack.advance(req)  # pack: scatters staged sources whose READ is DONE
                now = self._clock()  # on CPU that scatter ran inside the call: DONE is stamped after it
            states = [check(h) for h in req.handles]
            all_done = all(s is XferState.DONE for s in states)
            if not staged:  # direct READs only: the pack reader just stamps the time they are all done
                pack_error = None
                if all_done:
                    pack.on_reads_done(req)
                    now = self._clock()  # after the stamp, which DONE must not precede
            awaiting = req.awaiting_claims
            lost = next((a for a in awaiting if self._is_lost(a)), None) if awaiting else None
            if pack_error is not None:
                self._on_post_error(req, getattr(pack_error, "peer", None) or "?", pack_error, now)
            elif not all_done and XferState.ERR in states:
                self._on_read_error(req, now)
            elif lost is not None:  # its bytes may be in place (a mapped copy ends in the call), its claim never
                self._end(req, SourceLostError(request_id=req.request_id, agent=lost,
                                               detail=str(self._records[lost].error)), now, FailureCause.SOURCE_LOST)
            # A direct request has no staged source to settle (has_staged is False exactly then).
            elif all_done and not awaiting and not len(self._inbox) and (not staged or pack.is_settled(req)):
                self._complete(req, now)
            elif now >= req.deadline:
                self._end(req, self._deadline_error(req), now, FailureCause.DEADLINE)

    def _on_read_error(self, req: ReadRequest, now: float) -> None:
        bad = [h for h in req.handles if h.state is XferState.ERR]
        for h in bad:
            if isinstance(h.error, PeerDisconnectedError):
                self._lose(h.peer, h.error)
        gone = next((h for h in bad if self._is_lost(h.peer)), None)
        if gone is not None:
            self._end(req, SourceLostError(request_id=req.request_id, agent=gone.peer, detail=str(gone.error)), now,
                      FailureCause.SOURCE_LOST)
        else:
            h = bad[0]
            error = h.error or EngineError("READ ended in error", operation="READ", agent=self.agent.name, peer=h.peer)
            self._end(req, error, now, FailureCause.NIXL)

    def _plan(self, t: wire.Ticket, local_ids, link: EngineLink, first_token: int = 0) -> ReadPlan:
        """A request's one plan (validated once, here), against ``link``'s planner."""
        link = link.resolve()
        return link.planner.plan(local_ids, t.block_ids, t.num_tokens, self._pack.plan_mode,
                                 cost=self._pack.cost_for(link), first_token=first_token)

    def _post(self, req: ReadRequest, plan: ReadPlan, now: float) -> None:
        transition(req, ReadState.READING, now)
        link = req.link.resolve()
        req.notify = tuple((n.source_rank, n.expected_consumers) for n in plan.notify)
        # The claim leaves first: its confirmation's round trip then overlaps the posts and the copy
        # instead of following them (DONE waits for it, docs/lifecycle.md).
        self._claim(req, [link.agents[src.source_rank] for src in plan.sources])
        self._pack.on_post(req, now)
        for src in plan.sources:
            try:  # direct, or through the source's staging as the plan says (engine/pack/reader.py)
                self.stats.reads_posted += self._pack.post(req, src, link)
            except EngineError as exc:
                self._on_post_error(req, link.agents[src.source_rank], exc, now)
                return

    def _claim(self, req: ReadRequest, agents: Sequence[str]) -> None:
        """Claim the ticket at every source agent, before the READs (claims.py): DONE waits for their confirmations."""
        t = req.ticket
        message = wire.encode(wire.Claim(request_id=t.request_id, nonce=t.nonce, consumer_rank=self.tp_rank,
                                         digest=claims.digest_of(t)), self._digest)
        for agent in dict.fromkeys(agents):
            req.awaiting_claims.add(agent)
            if self._send(agent, message):
                self.stats.claims_sent += 1

    def _on_post_error(self, req: ReadRequest, peer: str, exc: HybridTransferError, now: float) -> None:
        if isinstance(exc, PeerDisconnectedError):
            self._lose(peer, exc)
            self._end(req, SourceLostError(request_id=req.request_id, agent=peer, detail=str(exc)), now,
                      FailureCause.SOURCE_LOST)
        else:
            self._end(req, exc, now, FailureCause.NIXL)

    def _complete(self, req: ReadRequest, now: float) -> None:
        """Every READ is DONE: the bytes are in place. Only now tell the producer ranks.

        The bytes moved are checked against what the layout says the request needs (engine/metrics.py):
        a difference fails the request (cause byte_count), it is never reported DONE.
        """
        # A partial kernel page of an interior that is not token-major moves whole (docs/attention-layouts.md).
        needed = self._expected_bytes(self.geometry.moved_token_end(req.ticket.num_tokens), req.first_token)
        fields = req.result_fields = self._pack.result_fields(req.request_id)
        if not metrics.bytes_agree(self.config.mode, req.num_bytes, needed, bool(fields.get("num_packed_sources"))):
            self._recorder.byte_mismatches += 1
            self._end(req, ByteCountError(local_bytes=req.num_bytes, remote_bytes=req.num_bytes,
                                          expected_bytes=needed), now, FailureCause.BYTE_COUNT)
            return
        self._recorder.on_done(needed, req.num_bytes, req.num_descriptors,
                               now - (fields.get("posted_at") or req.started_at))
        self._tell_producers(req, wire.CompletionKind.DONE)
        # A share of a READ others still hold is no leftover: the last sharer's release frees the READ (each
        # sharer is a live request, which lets go of its share when it ends).
        leftovers = [h for h in req.handles if not self.reads.release(h) and not _held_by_others(h)]
        if leftovers:  # DONE handles write nothing more; NIXL lets go of them on a later poll
            self._leftovers += 1
            self._quarantine.add(f"\0done:{self._leftovers}", (), leftovers)
        transition(req, ReadState.DONE, now)
        self.stats.done += 1

    def _end(self, req: ReadRequest, error: HybridTransferError, now: float,
             cause: FailureCause | None = None) -> None:
        """Fail (with ``cause``) or abort (without) a live request; the one path out for both.

        Its producer ranks are told at once (a READ still in flight lands only in quarantined
        blocks), its handles are released where NIXL lets go, and it is reported once its blocks
        leave the quarantine.
        """
        req.error, req.cause = error, cause
        transition(req, ReadState.DRAINING if cause is not None else ReadState.ABORTING, now)
        self._quarantine.add(req.request_id, (b for group in req.written_block_ids for b in group), req.handles)
        self._tell_producers(req, wire.CompletionKind.FAILED if cause is not None else wire.CompletionKind.ABORTED)
        if self._quarantine.sweep(self._release, [req.request_id]):
            self._finish_ending(req, now)

    def _release(self, handle) -> bool:
        """For the quarantine: progress a handle, then let go of it if NIXL allows."""
        self.reads.check(handle)
        return self.reads.release(handle)

    def _finish_ending(self, req: ReadRequest, now: float) -> None:
        if req.state is ReadState.ABORTING:
            transition(req, ReadState.ABORTED, now)
            self.stats.aborted += 1
        else:
            transition(req, ReadState.FAILED, now)
            self.stats.failed += 1
            self.failure_causes[req.cause.value if req.cause else "unknown"] += 1

    def _collect(self, now: float) -> list[ReadResult]:
        """Let out of quarantine what nothing can write any more; report and forget every ended request."""
        for key in self._quarantine.sweep(self._release):
            req = self._requests.get(key)
            if req is not None and req.state in ENDING:
                self._finish_ending(req, now)
        results = []
        for req in list(self._requests.values()):
            if req.state not in TERMINAL:
                continue
            del self._requests[req.request_id]
            self._owned.difference_update(*req.written_block_ids)  # each was this request's alone (_register)
            results.append(ReadResult(req.request_id, req.state, req.written_block_ids, req.num_bytes,
                                      req.num_descriptors, req.started_at, req.changed_at, req.error, req.cause,
                                      **(req.result_fields or self._pack.result_fields(req.request_id))))
            self._pack.forget(req.request_id)  # terminal: no handle writes its staging any more
        return results

    def _owner_of(self, block_id: int) -> str:
        """The not yet reported request that writes ``block_id`` (for BlockBusyError; never on the hot path)."""
        return next((r.request_id for r in self._requests.values()
                     if any(block_id in group for group in r.written_block_ids)), "?")

    def _tell_producers(self, req: ReadRequest, kind: wire.CompletionKind) -> None:
        """Tell every producer rank the request depends on that this rank is finished with it (docs/lifecycle.md#who-notifies-whom)."""
        link = req.link.resolve()
        if req.disowned:
            return  # a producer refused our claim: this rank has no standing to report on the ticket
        if link.state is not LinkState.READY:
            return  # no producer rank knows this agent yet: their leases free the blocks
        notify = req.notify or tuple((n.source_rank, n.expected_consumers) for n in link.planner.notify)
        self._notify_producers(req.ticket, link, notify, kind)

    def _notify_producers(self, t: wire.Ticket, link: EngineLink, notify: Sequence[tuple[int, int]],
                          kind: wire.CompletionKind) -> None:
        """One Completion of ``kind`` to each (producer rank, expected consumers) of ``notify``."""
        for source_rank, expected in notify:
            peer = link.agents.get(source_rank)
            if peer is None or self._is_lost(peer):
                continue
            if self._batched:
                self._outbox.add(peer, wire.CompletionEntry(t.request_id, t.nonce, expected, kind))
                continue
            message = wire.encode(wire.Completion(request_id=t.request_id, nonce=t.nonce, consumer_rank=self.tp_rank,
                                                  expected_consumers=expected, kind=kind), self._digest)
            if self._send(peer, message):
                self.stats.notifications_sent += 1
            else:
                self.stats.notify_failures += 1

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
        if hasattr(self, "_outbox"):  # completions still waiting leave before the Byes (no READ is posted now)
            self._outbox.flush(self._send_body, self.tp_rank)
        bye = None
        for agent, record in list(getattr(self, "_records", {}).items()):
            if record.stage in (PeerStage.GREETED, PeerStage.WELCOMED):
                bye = bye or wire.encode(wire.Bye(consumer_rank=self.tp_rank), self._digest)
                self._send(agent, bye)
        if bye is not None:
            try:
                self.agent.get_notifs()  # progress once: the Byes leave before the agent goes
            except EngineError as exc:
                log.info("consumer %s: %s", self.agent.name, exc)
        for req in getattr(self, "_requests", {}).values():
            for handle in req.handles:
                self.reads.release(handle)
        if self._peers is not None:
            self._peers.close()
        if self.reads is not None:
            self.reads.close()
        if self._pack is not None:
            self._pack.close()
        self.agent.close()

    def __enter__(self) -> Consumer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _held_by_others(handle) -> bool:
    """A DONE SharedRead this request let go of while other requests of its step still hold the READ."""
    return isinstance(handle, SharedRead) and handle.dropped and handle.base.shares > 0 \
        and handle.state is XferState.DONE


def _device_setter(device) -> Callable[[], None]:
    """For the posting thread: make ``device`` current there, so UCX posts with the cache's CUDA context."""
    def set_device() -> None:
        import torch

        torch.cuda.set_device(device)
    return set_device
