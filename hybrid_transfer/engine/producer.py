"""The prefill side: pin a request's blocks, hand out a ticket, free them once every consumer is done.

Threads: the thread that builds a Producer owns it and its NIXL agent (hold, poll,
close). A named daemon thread answers handshakes from immutable, precomputed data
(handshake.ProducerCard) and passes the names of accepted consumer agents back
through a queue.
"""

from __future__ import annotations

import logging
import queue
import secrets
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import wire
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.handshake import ListenerStats, ProducerCard, answer
from hybrid_transfer.engine.side_channel import HandshakeServer
from hybrid_transfer.engine.state import Hold, HoldState, transition
from hybrid_transfer.errors import ConfigError, RequestStateError, WireDecodeError
from hybrid_transfer.layout.fingerprint import fingerprint_of
from hybrid_transfer.plan.rank import describe_rank
from hybrid_transfer.plan.validate import block_id_arrays, validate_block_ids

log = logging.getLogger(__name__)

_MAX_EXPECTED_CONSUMERS = 1 << 16


@dataclass
class ProducerStats:
    """Notifications by outcome; only ``completions`` ever frees anything."""

    completions: int = 0  # valid, counted towards a free
    freed: int = 0
    malformed: int = 0  # not a Completion of ours (garbage, other version or fingerprint)
    unknown_agent: int = 0  # from an agent that never completed a handshake with this rank
    unknown_request: int = 0  # no such request held (never, or already freed)
    bad_nonce: int = 0  # the request is held, but the sender was not handed its ticket
    duplicate: int = 0  # this consumer rank already reported the request
    inconsistent: int = 0  # an expected-consumer count that contradicts an earlier one


class Producer:
    """One prefill TP rank.

    Args:
        cache: this rank's cache (its geometry gives tp_rank and tp_size).
        config: engine settings (validated here).
        engine_id, incarnation: the producer engine's identity; pass the same values on every rank
            of the engine (defaults: random, fine for a one-rank engine).
        clock: monotonic seconds, injectable for tests.
    """

    def __init__(self, cache: HybridCache, config: EngineConfig | None = None, *, engine_id: str | None = None,
                 incarnation: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.config = (config or EngineConfig()).validate()
        self.cache = cache
        self.geometry = cache.geometry
        self.engine_id = engine_id or uuid.uuid4().hex[:12]
        self.incarnation = incarnation if incarnation is not None else secrets.randbits(62)
        self.tp_rank, self.tp_size = self.geometry.tp_rank, self.geometry.tp_size
        self._clock = clock
        self._kinds = tuple(g.kind for g in self.geometry.tensor_map.groups)
        self.agent = NixlAgent(f"{self.engine_id}-p{self.tp_rank}-{self.incarnation:x}", self.config)
        self._closed = False
        self._server: HandshakeServer | None = None
        try:
            self.agent.register(cache.regions)
            regions = cache.regions
            self.descriptor = describe_rank(self.geometry, [r.addr for r in regions], cache.num_blocks,
                                            device_id=regions[0].device_id, is_cuda=regions[0].is_cuda)
            self.fingerprint = fingerprint_of(self.geometry)
            self._digest = self.fingerprint.digest()
            self._metadata = self.agent.metadata
            self._accepted: queue.SimpleQueue[str] = queue.SimpleQueue()
            self.listener_stats = ListenerStats()
            self._card: ProducerCard | None = None
            self._server = HandshakeServer(self.config.side_channel_host, self.config.side_channel_port,
                                           self._respond, name=f"hybrid-transfer-handshake-{self.agent.name}")
            self.address = self._server.address
            self._set_card(() if self.tp_size > 1 else (self.address,))
            self._server.start()
        except BaseException:
            self.close()
            raise
        self.stats = ProducerStats()
        self._holds: dict[str, Hold] = {}
        self._pins: dict[int, int] = {}  # block id -> number of holds pinning it
        self._known_agents: set[str] = set()

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
                                  self._metadata, self.engine_id, self.incarnation, addresses)

    def _respond(self, data: bytes) -> bytes | None:
        """Runs on the listener thread."""
        card = self._card  # set before the listener starts
        return answer(card, data, self.listener_stats, self._accepted.put) if card is not None else None

    # ---- requests -----------------------------------------------------------------
    def hold(self, request_id: str, block_ids_per_group: Sequence[Sequence[int]], num_tokens: int, *,
             nonce: int | None = None) -> wire.Ticket:
        """Pin a request's blocks and return its ticket.

        Call only once the prefill step's writes to these blocks are complete: a READ may start
        the moment the ticket exists. Every rank of the engine holds the request with the same
        block ids; rank 0 draws the nonce, the other ranks pass ``nonce=ticket.nonce``.

        Raises:
            RequestStateError: the request is already held.
            PlanError (subclasses): block ids of the wrong count, out of range or repeated.
            ConfigError: a rank other than 0 without rank 0's nonce, or engine addresses not set.
        """
        self._check_open()
        if request_id in self._holds:
            raise RequestStateError("is already held", request_id=request_id, state=HoldState.HELD.value)
        if nonce is None and self.tp_rank != 0:
            raise ConfigError(f"rank {self.tp_rank} must hold {request_id!r} with rank 0's nonce", field="nonce")
        if len(self.engine_addresses) != self.tp_size:
            raise ConfigError("call set_engine_addresses() before hold() on a multi-rank engine",
                              field="engine_addresses")
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ConfigError(f"num_tokens={num_tokens!r} must be a non-negative integer", field="num_tokens",
                              value=num_tokens)
        ids = block_id_arrays("producer", block_ids_per_group, len(self._kinds))
        validate_block_ids("producer", ids, self._kinds, num_tokens, self.geometry.block_size,
                           self.cache.num_blocks, exact=True)
        block_ids = tuple(tuple(int(b) for b in arr) for arr in ids)
        nonce = secrets.randbits(63) if nonce is None else int(nonce)
        now = self._clock()
        self._holds[request_id] = Hold(request_id, nonce, block_ids, num_tokens, held_at=now, changed_at=now)
        for group in block_ids:
            for b in group:
                self._pins[b] = self._pins.get(b, 0) + 1
        return wire.Ticket(
            engine_id=self.engine_id, incarnation=self.incarnation, addresses=self.engine_addresses,
            tp_size=self.tp_size, request_id=request_id, nonce=nonce, block_ids=block_ids,
            num_tokens=num_tokens, state_position=num_tokens, lease_s=float(self.config.lease_s),
        )

    def is_held(self, request_id: str) -> bool:
        return request_id in self._holds

    @property
    def num_held_requests(self) -> int:
        return len(self._holds)

    @property
    def num_held_blocks(self) -> int:
        """Distinct blocks pinned by at least one request."""
        return len(self._pins)

    def poll(self) -> list[str]:
        """Progress NIXL, take in completion notifications, and return the request ids freed now."""
        self._check_open()
        while True:
            try:
                self._known_agents.add(self._accepted.get_nowait())
            except queue.Empty:
                break
        freed: list[str] = []
        for sender, messages in self.agent.get_notifs().items():
            for message in messages:
                request_id = self._on_notification(sender, message)
                if request_id is not None:
                    freed.append(request_id)
        return freed

    def _on_notification(self, sender: str, message: bytes) -> str | None:
        """Count one notification; return the request id when it completes the request."""
        try:
            env, body = wire.decode(message, wire.Kind.COMPLETION)
        except WireDecodeError as exc:
            self.stats.malformed += 1
            log.info("producer %s: malformed notification from %s: %s", self.agent.name, sender, exc)
            return None
        if env.fingerprint != self._digest or not isinstance(body, wire.Completion) or not (
                1 <= body.expected_consumers <= _MAX_EXPECTED_CONSUMERS):
            self.stats.malformed += 1
            return None
        if sender not in self._known_agents:
            self.stats.unknown_agent += 1
            log.warning("producer %s: notification from %s, which never handshaked", self.agent.name, sender)
            return None
        hold = self._holds.get(body.request_id)
        if hold is None:
            self.stats.unknown_request += 1
            return None
        if body.nonce != hold.nonce:
            self.stats.bad_nonce += 1
            log.warning("producer %s: wrong nonce for %r from %s", self.agent.name, body.request_id, sender)
            return None
        if body.consumer_rank in hold.heard:
            self.stats.duplicate += 1
            return None
        if hold.expected_consumers is None:
            hold.expected_consumers = body.expected_consumers
        elif body.expected_consumers != hold.expected_consumers:
            self.stats.inconsistent += 1
            return None
        hold.heard[body.consumer_rank] = sender
        self.stats.completions += 1
        if len(hold.heard) < hold.expected_consumers:
            return None
        self._free(hold)
        return hold.request_id

    def _free(self, hold: Hold) -> None:
        transition(hold, HoldState.FREED, self._clock())
        del self._holds[hold.request_id]
        for group in hold.block_ids:
            for b in group:
                left = self._pins[b] - 1
                if left:
                    self._pins[b] = left
                else:
                    del self._pins[b]
        self.stats.freed += 1

    # ---- teardown -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RequestStateError("the producer is closed", request_id="*")

    def close(self) -> None:
        """Stop the listener and release NIXL; idempotent. Held requests are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.close()
        self.agent.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
