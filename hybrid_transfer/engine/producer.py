"""The prefill side: pin a request's blocks, hand out a ticket, free them once every consumer is done.

Threads: the thread that builds a Producer owns it and its NIXL agent (hold, poll,
close). A named daemon thread answers handshakes from immutable, precomputed data
(handshake.ProducerCard) and records the names of accepted consumer agents in a
locked, bounded table (lifecycle/pending.py) until they say Hello.

Lifecycle (issue 5; the rules live in lifecycle/holds.py): leases on this rank's clock, renewed by
consumer heartbeats; aborts that revoke the ticket at every consumer agent that may read it;
step fences before blocks go back to the embedder. Consumer agents introduce themselves with
a Hello after their handshake (their metadata, so this rank can notify them) and are answered
with a Welcome listing revoked tickets; a Bye, or NIXL reporting them disconnected, forgets them.

With a shared secret (issue 14, engine/auth.py) the listener gives agent metadata only to consumers
that proved the secret, and every notification is sealed under its link's key: one that fails the
check (forged, edited, replayed, unsealed) or names another consumer rank than its agent's Hello
is counted in ``rejections`` and dropped. One record per consumer agent (peer_record.py).

Fast reclaim (docs/lifecycle.md): every ``peer_probe_s`` the agents a hold waits for get one
notification; NIXL reporting one disconnected, or a new agent of the same consumer engine rank,
revokes the holds that agent claimed, through the abort path. A disconnected agent is remembered for
one lease (lifecycle/gone.py): a claim of it that arrives later, or was kept for a hold that comes
later, revokes that hold at once. A slow agent keeps its lease.

A hold answers to its reader (docs/lifecycle.md#who-reports, lifecycle/holds.py): once a claim for a
consumer rank was confirmed, only its agent reports for that rank; a report before any claim ends the
rank's part, and later claims for it are answered ENDED.
Held blocks are capped per rank (``EngineConfig.max_held_blocks``): a hold beyond it is refused.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import auth, claims, inputs, metrics, wire
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.handshake import ListenerAuth, ListenerStats, ProducerCard, answer
from hybrid_transfer.engine.inbox import Inbox
from hybrid_transfer.engine.lifecycle.early import EarlyCompletions
from hybrid_transfer.engine.lifecycle.fences import StepFences
from hybrid_transfer.engine.lifecycle.gone import GoneAgents
from hybrid_transfer.engine.lifecycle.holds import Heard, HoldBook
from hybrid_transfer.engine.lifecycle.pending import PendingHandshakes
from hybrid_transfer.engine.lifecycle.state import Hold, HoldState
from hybrid_transfer.engine.log_gate import LogGate
from hybrid_transfer.engine.mapped.offer import make_offer
from hybrid_transfer.engine.pack.stager import STAGING_MODES, Stager
from hybrid_transfer.engine.peer_record import PeerRecord, PeerStage, advance, consumer_slot
from hybrid_transfer.engine.side_channel import HandshakeServer
from hybrid_transfer.engine.tickets import RankCard
from hybrid_transfer.errors import (
    ConfigError,
    EngineError,
    PeerDisconnectedError,
    RequestStateError,
    TicketMismatchError,
    WireDecodeError,
)
from hybrid_transfer.layout.fingerprint import fingerprint_of
from hybrid_transfer.plan.validate import block_id_arrays, validate_block_ids
from hybrid_transfer.planner_input import describe_cache

log = logging.getLogger(__name__)

_MAX_EXPECTED_CONSUMERS = 1 << 16
# What consumers send a producer rank; any other kind arriving as a notification is malformed.
_FROM_CONSUMERS = (wire.Completion, wire.Heartbeat, wire.Hello, wire.RevokeAck, wire.Bye, wire.Claim, wire.Claims,
                   wire.Completions)


@dataclass
class ProducerStats:
    """Notifications by outcome; only valid completions, acks and the clock ever free anything."""

    completions: int = 0  # valid, counted towards a free (any kind)
    completions_aborted: int = 0  # ... of which the consumer's embedder aborted the request
    completions_failed: int = 0  # ... of which the consumer's read failed
    freed: int = 0  # holds whose blocks went back to the embedder (whatever their terminal state)
    malformed: int = 0  # not a message of ours (garbage, other version or fingerprint, a kind we never get)
    unknown_agent: int = 0  # from an agent that never completed a handshake with this rank
    unknown_request: int = 0  # a completion for no held request (not yet, or no longer): kept for its hold
    early_kept: int = 0  # completions kept for a hold that had not happened (engine/lifecycle/early.py)
    early_replayed: int = 0  # ... taken in by their hold
    early_lapsed: int = 0  # ... forgotten: no hold within the grace (or the expectation's lease)
    early_evicted: int = 0  # ... pushed out because too many were kept
    bad_nonce: int = 0  # the request is held, but the sender was not handed its ticket
    duplicate: int = 0  # this consumer rank already reported the request
    not_reader: int = 0  # reports ignored: another agent than the one whose claim for that rank was confirmed
    inconsistent: int = 0  # an expected-consumer count that contradicts an earlier one
    renewals: int = 0  # heartbeat entries that renewed a lease
    stale_heartbeats: int = 0  # heartbeat entries for unknown or ended requests (or another ticket's nonce)
    hellos: int = 0  # consumer agents welcomed
    acks: int = 0  # valid revocation acks
    stale_acks: int = 0  # acks for no revocation this rank waits for
    byes: int = 0
    revokes_sent: int = 0
    notify_failures: int = 0  # a Welcome or Revoke that could not be sent (the agent is then forgotten)
    handshakes_evicted: int = 0  # accepted agents forgotten before their Hello: the pending table was full
    handshakes_expired: int = 0  # ... because no Hello came within pending_handshake_s
    notifications_dropped: int = 0  # arrived while the backlog of unhandled notifications was full
    rejected: int = 0  # notifications that failed authentication or named another rank (by cause: rejections)
    claims_confirmed: int = 0  # claims on a live, unclaimed, unedited ticket (claims.py)
    claims_refused: int = 0  # ... answered otherwise (replayed, ended, revoked, edited)
    claims_kept: int = 0  # claims for a request not held (yet): kept like early completions
    claims_from_gone: int = 0  # claims of an agent NIXL had reported disconnected: each revokes its hold
    probes_sent: int = 0  # liveness checks of consumer agents a hold waits for (peer_probe_s)
    peers_lost: int = 0  # consumer agents NIXL reported disconnected
    incarnations_replaced: int = 0  # welcomed agents superseded by a new agent of the same engine and rank
    # Holds ended or revoked early because a consumer agent they waited for went away: a gone agent's
    # acknowledgement counted as given (it ended an abort), or its claimed hold revoked (fast reclaim).
    reclaims: int = 0


class Producer:
    """One prefill TP rank.

    Args:
        cache: this rank's cache (its geometry gives tp_rank and tp_size).
        config: engine settings (validated here).
        engine_id: the producer engine's name; pass the same value on every rank of the engine
            (default: random, fine for a one-rank engine).
        incarnation: distinguishes a restarted engine from its predecessor; same rule as ``engine_id``.
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(self, cache: HybridCache, config: EngineConfig | None = None, *, engine_id: str | None = None,
                 incarnation: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = (config or EngineConfig()).validate()
        self.cache = cache
        self.geometry = cache.geometry
        self.engine_id = inputs.engine_id(engine_id) if engine_id is not None else uuid.uuid4().hex[:12]
        self.incarnation = inputs.nonce("incarnation", incarnation) if incarnation is not None else secrets.randbits(62)
        self.tp_rank, self.tp_size = self.geometry.tp_rank, self.geometry.tp_size
        self._clock = clock
        self._kinds = tuple(g.kind for g in self.geometry.tensor_map.groups)
        self.agent = NixlAgent(f"{self.engine_id}-p{self.tp_rank}-{self.incarnation:x}", self.config,
                               device_memory=cache.device.type == "cuda")
        self._closed = False
        self._server: HandshakeServer | None = None
        self.stager: Stager | None = None  # pack and auto: gathers held requests into staging (pack/stager.py)
        try:
            self.agent.register(cache.regions)
            self.descriptor = describe_cache(cache)
            self.fingerprint = fingerprint_of(self.geometry)
            self._digest = self.fingerprint.digest()
            self._secret = auth.load_secret(self.config.secret_file)
            auth.warn_if_open(self._secret, f"producer {self.agent.name}")
            # The mapped path (engine/mapped/): handles of the cache's regions, sent only after a proof.
            self._map_offer = make_offer(cache, self.config.read_transport, self._secret)
            if self.config.mode in STAGING_MODES:  # registers its pool: before the metadata is read
                self.stager = Stager(self.agent, cache, self.config, self._digest)
            self._metadata = self.agent.metadata
            # Consumer agents between handshake and Hello; the listener thread adds to it (lifecycle/pending.py).
            self._pending = PendingHandshakes(clock, self.config.pending_handshake_s,
                                              self.config.max_pending_handshakes)
            self.listener_stats = ListenerStats()
            self.listener_auth = None if self._secret is None else ListenerAuth(
                self._secret, auth.Challenges(clock, self.config.handshake_timeout_s,  # a challenge lives one handshake
                                              self.config.max_pending_handshakes))
            self._card: ProducerCard | None = None
            self._server = HandshakeServer(self.config.side_channel_host, self.config.side_channel_port,
                                           self._respond, name=f"hybrid-transfer-handshake-{self.agent.name}",
                                           advertise_host=self.config.advertise_host,
                                           curve=auth.side_channel_curve(self.config.side_channel_curve,
                                                                         self._secret))
            self.address = self._server.address
            self._set_card(() if self.tp_size > 1 else (self.address,))
            self._server.start()
        except BaseException:
            self.close()
            raise
        self.stats = ProducerStats()
        self.fences = StepFences()
        self._book = HoldBook(clock, self.config.lease_s, self.fences, self.config.held_blocks_cap(cache.num_blocks))
        self._gone = GoneAgents(clock, self.config.lease_s, self.config.max_pending_handshakes)
        self._early = EarlyCompletions(clock, self.config.early_completion_grace_s, self.config.lease_s,
                                       self.config.early_completion_limit)
        # Consumer agents that said Hello and were welcomed (stage WELCOMED): the only readers.
        self._peers: dict[str, PeerRecord] = {}
        # A bounded amount of work per poll (inbox.py), and one log line per cause per interval (log_gate.py).
        self._inbox = Inbox(self.config.notifications_per_poll, self.config.notification_backlog_bytes)
        self._log = LogGate(log, clock)
        self.rejections = auth.RejectionLog(f"producer {self.agent.name}", self._log)  # .counts: cause -> dropped
        self._next_probe_at = 0.0  # producer clock: when poll() next checks the watched consumer agents

    # ---- identity ---------------------------------------------------------------
    @property
    def engine_addresses(self) -> tuple[str, ...]:
        return self._card.engine_addresses if self._card is not None else ()

    def set_engine_addresses(self, addresses: Sequence[str]) -> None:
        """Every rank's side-channel address (index == tp_rank); required before ``hold`` when TP > 1."""
        addresses = tuple(addresses)
        if len(addresses) != self.tp_size or addresses[self.tp_rank] != self.address:
            raise ConfigError(f"engine addresses {addresses} must list {self.tp_size} ranks with this rank's "
                              f"{self.address!r} at index {self.tp_rank}", field="engine_addresses", value=addresses)
        self._set_card(addresses)

    def _set_card(self, addresses: tuple[str, ...]) -> None:
        # One reference swap: the listener thread sees the old card or the new one, never a mix.
        self._card = ProducerCard(self.geometry.model, self.fingerprint, self.descriptor, self.agent.name,
                                  self._metadata, self.engine_id, self.incarnation, addresses,
                                  mapping=self._map_offer)

    def _respond(self, data: bytes) -> bytes | None:
        """Runs on the listener thread."""
        card = self._card  # set before the listener starts
        return answer(card, data, self.listener_stats, self._pending.add,
                      self.listener_auth) if card is not None else None

    # ---- requests -----------------------------------------------------------------
    def hold(self, request_id: str, block_ids_per_group: Sequence[Sequence[int]] | None = None,
             num_tokens: int | None = None, *, nonce: int | None = None,
             ticket: wire.Ticket | None = None) -> wire.Ticket:
        """Pin a request's blocks and return its ticket.

        Call only once the prefill step's writes to these blocks are complete: a READ may start
        the moment the ticket exists. Every rank of the engine holds the request with the same
        block ids and nonce: either rank 0 draws the nonce and the other ranks pass
        ``nonce=ticket.nonce``, or every rank passes the ``ticket`` its engine's scheduler issued
        (engine/tickets.py); block ids and token count may then be left out. A ticket must match
        this rank's view (engine id, incarnation, TP size, addresses, lease, request, blocks, tokens,
        nonce); it also tells a multi-rank engine its addresses when ``set_engine_addresses`` was not
        called. Completions that arrived before this call are taken in now (engine/lifecycle/early.py): the
        request may be released by the next poll().

        Raises:
            TicketMismatchError: the ticket disagrees with this rank (each difference named); nothing pinned.
            RequestStateError: the request is already held.
            PlanError (subclasses): block ids of the wrong count, out of range or repeated.
            ConfigError: a rank other than 0 without rank 0's nonce or a ticket, no block ids, engine
                addresses not set, or an argument of the wrong type or range (``field`` names it):
                request_id a non-empty str, num_tokens an int >= 0, nonce an int in [0, 2**63); bools
                are not ints.
            FenceError: a step marked as writing one of the blocks (mark_blocks_written) has not finished.
            HoldCapacityError: the blocks it would add take this rank's held blocks past
                ``EngineConfig.max_held_blocks`` (``held``, ``asked``, ``cap``); nothing pinned.
        """
        self._check_open()
        request_id = inputs.request_id(request_id)
        if ticket is not None:
            block_ids_per_group, num_tokens, nonce = self._check_ticket(request_id, block_ids_per_group, num_tokens,
                                                                        nonce, ticket)
        if block_ids_per_group is None:
            raise ConfigError(f"hold({request_id!r}) needs block ids or a ticket", field="block_ids_per_group")
        num_tokens = inputs.count("num_tokens", num_tokens)
        if nonce is not None:
            nonce = inputs.nonce("nonce", nonce)
        inputs.block_id_lists("producer", block_ids_per_group)
        if self._book.get(request_id) is not None:
            raise RequestStateError("is already held", request_id=request_id, state=HoldState.HELD.value)
        if nonce is None and self.tp_rank != 0:
            raise ConfigError(f"rank {self.tp_rank} must hold {request_id!r} with rank 0's nonce", field="nonce")
        if len(self.engine_addresses) != self.tp_size:
            raise ConfigError("call set_engine_addresses() before hold() on a multi-rank engine",
                              field="engine_addresses")
        ids = block_id_arrays("producer", block_ids_per_group, len(self._kinds))
        validate_block_ids("producer", ids, self._kinds, num_tokens, self.geometry.block_size,
                           self.cache.num_blocks, exact=True)
        block_ids = tuple(tuple(int(b) for b in arr) for arr in ids)
        if ticket is not None and not claims.mac_ok(ticket, self._secret):  # edited, or signed without our secret
            raise TicketMismatchError(request_id=request_id, differences=[
                ("mac", "a MAC of the ticket's fields under this engine's ticket key", ticket.mac.hex())])
        nonce = secrets.randbits(63) if nonce is None else nonce
        hold = self._book.add(request_id, nonce, block_ids, num_tokens)
        hold.digest = claims.ticket_digest(self.engine_id, self.incarnation, request_id, nonce, block_ids, num_tokens,
                                           num_tokens)
        if self.stager is not None:
            self.stager.stage(request_id, nonce, block_ids, num_tokens)
            self._announce_staged()  # CPU: the gather ran inside stage()
        for sender, completion in self._early.take(request_id, nonce):
            self.stats.early_replayed += 1
            if isinstance(completion, wire.Claim):
                self._on_claim(sender, completion)
            elif self._book.get(request_id) is hold:  # an earlier replay may have ended it
                self._count_report(sender, hold, completion)
        return ticket if ticket is not None else claims.sign(wire.Ticket(
            engine_id=self.engine_id, incarnation=self.incarnation, addresses=self.engine_addresses,
            tp_size=self.tp_size, request_id=request_id, nonce=nonce, block_ids=block_ids,
            num_tokens=num_tokens, state_position=num_tokens, lease_s=float(self.config.lease_s),
        ), self._secret)

    def _check_ticket(self, request_id: str, block_ids_per_group: Sequence[Sequence[int]] | None,
                      num_tokens: int | None, nonce: int | None, ticket: wire.Ticket):
        """Every disagreement between ``ticket`` and this rank, raised at once; else the hold's arguments."""
        if not isinstance(ticket, wire.Ticket):
            raise ConfigError(f"ticket must be a Ticket, got {type(ticket).__name__}", field="ticket")
        checks = [
            ("version", wire.PROTOCOL_VERSION, ticket.version),
            ("engine_id", self.engine_id, ticket.engine_id),
            ("incarnation", self.incarnation, ticket.incarnation),
            ("tp_size", self.tp_size, ticket.tp_size),
            ("lease_s", float(self.config.lease_s), float(ticket.lease_s)),
            ("request_id", request_id, ticket.request_id),
            ("state_position", ticket.num_tokens, ticket.state_position),
        ]
        if len(ticket.addresses) != self.tp_size or ticket.addresses[self.tp_rank] != self.address:
            checks.append(("addresses", f"{self.address} at index {self.tp_rank}", ticket.addresses))
        elif self.engine_addresses and self.engine_addresses != tuple(ticket.addresses):
            checks.append(("addresses", self.engine_addresses, ticket.addresses))
        if block_ids_per_group is not None:
            given = tuple(tuple(int(b) for b in group) for group in block_ids_per_group)
            checks.append(("block_ids", given, ticket.block_ids))
        if num_tokens is not None:
            checks.append(("num_tokens", num_tokens, ticket.num_tokens))
        if nonce is not None:
            checks.append(("nonce", nonce, ticket.nonce))
        differences = [(name, ours, theirs) for name, ours, theirs in checks if ours != theirs]
        if differences:
            raise TicketMismatchError(request_id=request_id, differences=differences)
        if not self.engine_addresses:
            self.set_engine_addresses(ticket.addresses)
        return ticket.block_ids, ticket.num_tokens, ticket.nonce

    def expect(self, request_id: str, nonce: int) -> None:
        """This rank will hold ``request_id`` with ``nonce`` soon: keep its early completions until then.

        For embedders that learn the nonce before they can hold (a scheduler issued the ticket);
        the expectation lapses after one lease. Without it, early completions are still kept for
        ``early_completion_grace_s``.
        """
        self._check_open()
        self._early.expect(request_id, int(nonce))

    @property
    def rank_card(self) -> RankCard:
        """What this rank publishes to its engine's scheduler (engine/tickets.py): its bound address included."""
        return RankCard(engine_id=self.engine_id, incarnation=self.incarnation, tp_rank=self.tp_rank,
                        tp_size=self.tp_size, address=self.address, lease_s=float(self.config.lease_s),
                        block_size=self.geometry.block_size, num_blocks=self.cache.num_blocks,
                        group_kinds=self._kinds, fingerprint=self._digest, agent_name=self.agent.name)

    def is_held(self, request_id: str) -> bool:
        """Held and not ended (an aborting request is still held)."""
        return self._book.get(request_id) is not None

    def hold_state(self, request_id: str) -> HoldState | None:
        hold = self._book.get(request_id)
        return hold.state if hold is not None else None

    @property
    def num_held_requests(self) -> int:
        return self._book.num_held_requests

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks pinned by at least one request (ended ones waiting for step fences included)."""
        return self._book.num_pinned_blocks

    @property
    def held_blocks_cap(self) -> int:
        """The most blocks this rank keeps pinned (``EngineConfig.max_held_blocks``); ``hold()`` refuses beyond it."""
        return self._book.max_pinned_blocks

    @property
    def notification_backlog(self) -> int:
        """Notifications taken from NIXL and left for a later poll (at most notifications_per_poll per poll)."""
        return len(self._inbox)

    @property
    def num_pending_handshakes(self) -> int:
        """Consumer agents accepted at the handshake that have not said Hello yet (bounded, see lifecycle/pending.py)."""
        return len(self._pending)

    @property
    def terminal_counts(self) -> dict[str, int]:
        """Holds that ended, by terminal state (freed / expired / aborted)."""
        return dict(self._book.terminal_counts)

    def metrics(self) -> metrics.ProducerMetrics:
        """A snapshot of this rank's holds, leases, reclaims and rejections (engine/metrics.py)."""
        return metrics.producer_metrics(self)

    def abort(self, request_id: str) -> bool:
        """The embedder gives up on a held request; False when it is not held (or already aborting).

        Frees at once when no consumer agent can be reading; otherwise revokes the ticket at
        every agent that may read it and frees once all have acknowledged, every expected consumer
        rank has reported, or the lease expires (lifecycle/holds.py). poll() reports the release.
        """
        self._check_open()
        hold = self._book.get(request_id)
        if hold is None or hold.state is not HoldState.HELD:
            return False
        readers = set(self._peers)
        self._book.abort(hold, readers)
        self._send_revokes(hold, readers)
        return True

    def mark_blocks_written(self, block_ids: Sequence[int], step: int) -> None:
        """Engine step ``step`` writes these blocks: hold() refuses them and poll() keeps them until it finished."""
        self.fences.mark(block_ids, step)

    def finish_step(self, step: int) -> None:
        """Every engine step up to ``step`` has finished on the device."""
        self.fences.finish(step)

    def poll(self) -> list[str]:
        """Progress NIXL, take in notifications, end expired leases; return the request ids released now.

        A released request's blocks are back with the embedder: it ended (freed, expired or
        aborted) and the step fences of its blocks have passed.
        """
        self._check_open()
        self._pending.expire()
        self.stats.handshakes_evicted = self._pending.num_evicted
        self.stats.handshakes_expired = self._pending.num_expired
        self._inbox.put(self.agent.get_notifs())  # every poll: it also progresses the target side of READs
        if self._inbox.num_dropped > self.stats.notifications_dropped:
            self._log.warning("backlog full", "producer %s: notification backlog full, %d dropped so far",
                              self.agent.name, self._inbox.num_dropped)
            self.stats.notifications_dropped = self._inbox.num_dropped
        for sender, message in self._inbox.take():
            self._on_notification(sender, message)
        lapsed = self._early.prune()
        if lapsed:
            self.stats.early_lapsed += lapsed
            log.info("producer %s: %d early completions found no hold in time", self.agent.name, lapsed)
        self.stats.early_evicted = self._early.stats.evicted
        self._log.flush()
        self._probe()
        for hold in self._book.expire():
            if hold.state is HoldState.EXPIRED:
                log.info("producer %s: lease of %r expired", self.agent.name, hold.request_id)
                self._send_revokes(hold, set(self._peers))
        released = self._book.pop_released()
        if self.stager is not None:
            self._announce_staged()  # gathers seen done (CUDA: events)
            for request_id in released:
                self.stager.release(request_id)
        self.stats.freed += len(released)
        return released

    def _on_notification(self, sender: str, message: bytes) -> None:
        """Check and count one notification, then act on it."""
        try:
            env = wire.decode_envelope(message)
            if env.fingerprint != self._digest:
                raise WireDecodeError(f"fingerprint {env.fingerprint!r} is not ours")
            record = self._peers.get(sender)
            pending = self._pending.get(sender)
            gone = self._gone.get(sender) if record is None and pending is None else None
            if record is None and pending is None and gone is None:
                self.stats.unknown_agent += 1
                self._log.warning("unknown agent", "producer %s: notification from %s, which never handshaked",
                                  self.agent.name, sender)
                return
            env, record = self._unseal(sender, env, record, pending or gone)
            if env is None:
                return
            body = wire.decode_body(env)
        except WireDecodeError as exc:
            self.stats.malformed += 1
            self._log.log(logging.INFO, "malformed", "producer %s: malformed notification from %s: %s",
                          self.agent.name, sender, exc)
            return
        if not isinstance(body, _FROM_CONSUMERS) or (
                isinstance(body, wire.Completion) and not 1 <= body.expected_consumers <= _MAX_EXPECTED_CONSUMERS):
            self.stats.malformed += 1
            return
        rank = getattr(body, "consumer_rank", None)
        if rank is not None and record.link is not None:  # authenticated: one agent speaks for one rank
            if record.rank is None:
                record.rank = rank  # bound by the agent's first message, its Hello
            elif rank != record.rank:
                self._reject("rank", sender)
                return
        if isinstance(body, wire.Completions) and not all(
                1 <= e.expected_consumers <= _MAX_EXPECTED_CONSUMERS for e in body.entries):
            self.stats.malformed += 1
            return
        if gone is not None and not isinstance(body, (wire.Claim, wire.Claims)):
            self.stats.unknown_agent += 1  # sent before it died; only its claims still matter (lifecycle/gone.py)
            return
        if isinstance(body, wire.Completion):
            self._on_completion(sender, body)
        elif isinstance(body, wire.Heartbeat):
            self._on_heartbeat(body)
        elif isinstance(body, wire.Hello):
            self._on_hello(sender, body, record)
        elif isinstance(body, wire.Claim):
            self._on_claim(sender, body)
        elif isinstance(body, wire.Claims):
            self._on_claims(sender, body)
        elif isinstance(body, wire.Completions):  # batched per poll (version 8): each entry as one Completion
            for e in body.entries:
                self._on_completion(sender, wire.Completion(request_id=e.request_id, nonce=e.nonce,
                                                            consumer_rank=body.consumer_rank,
                                                            expected_consumers=e.expected_consumers, kind=e.kind))
        elif isinstance(body, wire.RevokeAck):
            heard = self._book.ack(body.request.request_id, body.request.nonce, sender)
            if heard is Heard.STALE:
                self.stats.stale_acks += 1
            else:
                self.stats.acks += 1
        else:  # Bye
            self.stats.byes += 1
            self._forget(sender)

    def _unseal(self, sender: str, env: wire.Envelope, record: PeerRecord | None,
                pending: PeerRecord | None) -> tuple[wire.Envelope | None, PeerRecord]:
        """The inner envelope and the record whose link it came through; (None, ...) when it was rejected.

        Without a secret: the envelope itself, under the welcomed record (else the pending one). With
        one, a welcomed agent's link is tried first, then a newer handshake's (the agent handshaked again).

        Raises:
            WireDecodeError: a sealed message that does not decode, or one where none is expected.
        """
        fallback = record if record is not None else pending
        if self._secret is None:
            if env.kind is wire.Kind.SEALED:
                raise WireDecodeError("a sealed notification, but this producer has no secret")
            return env, fallback
        if env.kind is not wire.Kind.SEALED:
            self._reject("unsealed", sender)
            return None, fallback
        sealed = wire.decode_body(env)
        cause = "mac"
        for candidate in (record, pending):
            if candidate is None or candidate.link is None:
                continue
            try:
                candidate.link.check(sealed.counter, sealed.mac, sealed.message)
            except auth.Rejected as exc:
                cause = exc.cause if exc.cause == "replay" else cause
                continue
            inner = wire.decode_envelope(sealed.message)
            if inner.fingerprint != self._digest or inner.kind is wire.Kind.SEALED:
                raise WireDecodeError("a sealed notification whose inner message is not ours")
            return inner, candidate
        self._reject(cause, sender)
        return None, fallback

    def _reject(self, cause: str, sender: str) -> None:
        self.stats.rejected += 1
        self.rejections.add(cause, sender)

    def _on_completion(self, sender: str, body: wire.Completion) -> None:
        hold = self._book.get(body.request_id)
        if hold is None:  # not held yet (a scheduler issued the ticket) or any more: kept for its hold
            self.stats.unknown_request += 1
            self._early.keep(sender, body)
            self.stats.early_kept += 1
            return
        if body.nonce != hold.nonce:
            self.stats.bad_nonce += 1
            self._log.warning("bad nonce", "producer %s: wrong nonce for %r from %s", self.agent.name,
                              body.request_id, sender)
            return
        self._count_report(sender, hold, body)

    def _on_claims(self, sender: str, body: wire.Claims) -> None:
        """A batched claim (version 8): each request judged as a single Claim, the verdicts in one reply."""
        verdicts = []
        for e in body.entries:
            status = self._judge_claim(sender, wire.Claim(request_id=e.request_id, nonce=e.nonce,
                                                          consumer_rank=body.consumer_rank, digest=e.digest))
            if status is not None:
                verdicts.append(wire.ClaimVerdict(wire.RequestRef(e.request_id, e.nonce), status))
        if verdicts:
            self._notify(sender, wire.ClaimReplies(consumer_rank=body.consumer_rank, verdicts=tuple(verdicts)))

    def _on_claim(self, sender: str, body: wire.Claim) -> None:
        status = self._judge_claim(sender, body)
        if status is not None:
            self._notify(sender, wire.ClaimReply(request=wire.RequestRef(body.request_id, body.nonce),
                                                 consumer_rank=body.consumer_rank, status=status))

    def _judge_claim(self, sender: str, body: wire.Claim) -> wire.ClaimStatus | None:
        """Confirm a consumer rank's first claim on a live ticket this rank holds as given; refuse any other.

        None when nothing is answered now: a claim of an agent NIXL reported disconnected revokes its hold
        instead (``_on_gone_claim``), one for a request not held yet is answered at its hold.
        """
        hold = self._book.get(body.request_id)
        key = (body.request_id, body.nonce)
        if sender not in self._peers and sender in self._gone:
            self._on_gone_claim(sender, body, hold)
            return None
        if hold is not None and hold.nonce == body.nonce:
            if hold.state is not HoldState.HELD:
                status = wire.ClaimStatus.REVOKED
            elif not auth.same(body.digest, hold.digest):
                status = wire.ClaimStatus.EDITED
            elif body.consumer_rank in hold.claimed:
                status = wire.ClaimStatus.CLAIMED
            elif body.consumer_rank in hold.heard:  # reported before any claim (a decline): the ticket is over for it
                status = wire.ClaimStatus.ENDED
            else:
                hold.claimed[body.consumer_rank] = sender
                status = wire.ClaimStatus.CONFIRMED
        elif key in self._book.ended or key in self._book.revocations():
            status = wire.ClaimStatus.ENDED
        elif hold is not None:
            status = wire.ClaimStatus.ENDED  # re-held with another nonce: this ticket is over
        else:  # not held yet (a scheduler issued the ticket): answered at its hold
            self.stats.claims_kept += 1
            self._early.keep(sender, body)  # type: ignore[arg-type]
            return None
        if status is wire.ClaimStatus.CONFIRMED:
            self.stats.claims_confirmed += 1
        else:
            self.stats.claims_refused += 1
            log.info("producer %s: claim of %r by rank %d refused: %s", self.agent.name, body.request_id,
                     body.consumer_rank, status.name)
        return status

    def _on_gone_claim(self, sender: str, body: wire.Claim, hold: Hold | None) -> None:
        """A claim of a dead agent: it may have READs posted, and it will never report. Revoke the hold now."""
        self.stats.claims_from_gone += 1
        if hold is not None and hold.nonce == body.nonce:
            if hold.state is HoldState.HELD:
                self._revoke_claimed(hold, sender)
        elif hold is None and (body.request_id, body.nonce) not in self._book.ended:
            self.stats.claims_kept += 1
            self._early.keep(sender, body)  # type: ignore[arg-type]  # its hold, when it comes, is revoked at once

    def _count_report(self, sender: str, hold: Hold, body: wire.Completion) -> None:
        heard = self._book.report(hold, body.consumer_rank, body.expected_consumers, sender)
        if heard is Heard.NOT_READER:
            self.stats.not_reader += 1
            self._log.warning("not reader", "producer %s: %s reported %r for consumer rank %d without its confirmed "
                              "claim: ignored", self.agent.name, sender, body.request_id, body.consumer_rank)
        elif heard is Heard.DUPLICATE:
            self.stats.duplicate += 1
        elif heard is Heard.INCONSISTENT:
            self.stats.inconsistent += 1
        else:
            self.stats.completions += 1
            if body.kind is wire.CompletionKind.ABORTED:
                self.stats.completions_aborted += 1
            elif body.kind is wire.CompletionKind.FAILED:
                self.stats.completions_failed += 1

    def _on_heartbeat(self, body: wire.Heartbeat) -> None:
        for ref in body.requests:
            hold = self._book.get(ref.request_id)
            if hold is None or hold.nonce != ref.nonce:
                self.stats.stale_heartbeats += 1
                continue
            self._book.renew(hold)
            self.stats.renewals += 1

    def _on_hello(self, sender: str, body: wire.Hello, record: PeerRecord) -> None:
        """Load the consumer agent's metadata and welcome it with the tickets this rank revoked."""
        try:
            name = sender if sender in self._peers else self.agent.add_remote(body.agent_metadata)
        except EngineError as exc:
            self.stats.malformed += 1
            self._log.warning("bad hello", "producer %s: Hello from %s with unusable metadata: %s", self.agent.name,
                              sender, exc)
            return
        if name != sender:
            self.stats.malformed += 1
            self._log.warning("bad hello", "producer %s: Hello from %s carries the metadata of %s", self.agent.name,
                              sender, name)
            return
        if self._notify(sender, self._welcome(), record):
            if record.stage is PeerStage.HANDSHAKEN:  # a first Hello, or one after a new handshake
                advance(record, PeerStage.WELCOMED, self._clock())
                self._peers[sender] = record
                self._pending.discard(sender)
                self._gone.discard(sender)
                record.slot = consumer_slot(sender, body.consumer_rank)
                self._replace_incarnations(record)
            self.stats.hellos += 1
            for staged in self.stager.current() if self.stager is not None else ():  # pack: what it missed
                self._notify(sender, staged, record)

    def _announce_staged(self) -> None:
        """Pack: tell every welcomed consumer agent where each request whose gather just finished is staged.

        Every agent, because which consumer reads a request is unknown here (engine/pack/stager.py).
        """
        for staged in self.stager.ready():
            for agent in list(self._peers):
                self._notify(agent, staged)

    def _welcome(self) -> wire.Welcome:
        revoked = tuple(wire.RequestRef(rid, nonce) for rid, nonce in self._book.revocations())
        return wire.Welcome(revoked=revoked, lease_s=float(self.config.lease_s), stages=self.stager is not None)

    # ---- fast reclaim (docs/lifecycle.md) -------------------------------------------------
    def _replace_incarnations(self, record: PeerRecord) -> None:
        """A new agent of a consumer engine rank was welcomed: revoke what its predecessors claimed.

        The predecessor stays a reader until it acknowledges or NIXL reports it disconnected (the
        Revoke itself, or a later probe), so even one that is still alive never reports DONE on
        blocks given back.
        """
        if record.slot is None:
            return
        for old in [r for r in self._peers.values() if r.slot == record.slot and r is not record]:
            self.stats.incarnations_replaced += 1
            log.info("producer %s: %s replaces %s", self.agent.name, record.agent, old.agent)
            old.slot = None  # replaced once
            self._reclaim(old.agent)

    def _probe(self) -> None:
        """Every peer_probe_s: one notification to each consumer agent a hold waits for.

        It is the Welcome that agent's Hello got (the current revocations), so it is safe at any
        moment. NIXL refusing it as disconnected is the sign (``_notify``); a slow agent takes it in
        and keeps its lease.
        """
        every = self.config.peer_probe_s
        now = self._clock()
        if not every or now < self._next_probe_at:
            return
        self._next_probe_at = now + every
        agents = sorted(a for a in self._book.watched_agents() if a in self._peers)
        message = self._welcome() if agents else None
        for agent in agents:
            if agent in self._peers:  # an earlier probe's reclaim may have forgotten it
                self.stats.probes_sent += 1
                self._notify(agent, message)

    def _reclaim(self, agent: str) -> None:
        """Revoke every request ``agent`` claimed and has not reported, exactly as ``abort`` does.

        The other agents that may read it must acknowledge first (holds.py); the blocks go back
        after that and their step fences, never while a live reader could still report DONE.
        """
        for hold in self._book.claimed_by(agent):
            if hold.state is HoldState.HELD:  # else ended by a reclaim further down this call
                self._revoke_claimed(hold, agent)

    def _revoke_claimed(self, hold: Hold, agent: str) -> None:
        readers = set(self._peers)
        self.stats.reclaims += 1
        log.info("producer %s: %r was claimed by %s, which is gone: revoked", self.agent.name, hold.request_id, agent)
        self._book.abort(hold, readers)
        self._send_revokes(hold, readers)

    def _send_revokes(self, hold: Hold, agents: set[str]) -> None:
        message = wire.Revoke(request=wire.RequestRef(hold.request_id, hold.nonce), lease_s=float(self.config.lease_s))
        for agent in sorted(agents):
            if self._notify(agent, message):
                self.stats.revokes_sent += 1

    def _notify(self, agent: str, body: wire.Body, record: PeerRecord | None = None) -> bool:
        """Send one message to a consumer agent (False when it failed); a disconnected agent is forgotten.

        With a secret it is sealed under the agent's link (``record``, else its welcomed record).
        """
        record = record or self._peers.get(agent)
        message = wire.encode(body, self._digest)
        if record is not None and record.link is not None:
            counter, mac = record.link.seal(message)
            message = wire.encode(wire.Sealed(counter=counter, mac=mac, message=message), self._digest)
        try:
            self.agent.send_notif(agent, message)
            return True
        except PeerDisconnectedError as exc:
            self.stats.notify_failures += 1
            self.stats.peers_lost += 1
            log.info("producer %s: %s is gone, forgetting it: %s", self.agent.name, agent, exc)
            # Remembered first: its claims still queued, or kept for a later hold, revoke their holds (gone.py).
            self._gone.add(self._peers.get(agent) or self._pending.get(agent) or record or PeerRecord(agent))
            self._forget(agent)
            self._reclaim(agent)
        except EngineError as exc:  # the agent stays a possible reader: an abort then waits for the lease
            self.stats.notify_failures += 1
            log.warning("producer %s: cannot notify %s: %s", self.agent.name, agent, exc)
        return False

    def _forget(self, agent: str) -> None:
        """A consumer agent reads nothing from here any more: drop it, and stop waiting for its acks."""
        self._pending.discard(agent)
        record = self._peers.pop(agent, None)
        if record is not None:
            advance(record, PeerStage.GONE, self._clock())
        self.stats.reclaims += len(self._book.forget_agent(agent))
        try:
            self.agent.remove_remote(agent)
        except EngineError as exc:
            log.info("producer %s: removing agent %s: %s", self.agent.name, agent, exc)

    # ---- teardown -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RequestStateError("the producer is closed", request_id="*")

    def close(self) -> None:
        """Stop the listener and release NIXL; idempotent. Held requests are dropped."""
        if self._closed:
            return
        self._closed = True
        book = getattr(self, "_book", None)
        if book is not None:
            book.drop_all()
        if self._server is not None:
            self._server.close()
        if self.stager is not None:
            self.stager.close()
        self.agent.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
