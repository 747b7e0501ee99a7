"""A consumer rank's links to producer engines: handshakes with every rank, then a cached Planner.

A link is keyed by the producer engine's (engine_id, incarnation), so a restarted
producer (new incarnation) is a new link. Handshakes are non-blocking: replies are
picked up by ``progress()``, which the consumer calls from its own poll().

With a shared secret (engine/auth.py) each rank's handshake takes two round trips: the producer's
challenge proves it knows the secret (before anything of ours is trusted), our second request
proves we do, and both sides derive the link key. A producer that accepts without a challenge is
refused: no downgrade. Each producer agent gets one PeerRecord (peer_record.py) in ``records``.

Links heal (issue 19, docs/security.md#links): a failed link keeps its one-word ``cause`` (the
producer's refusal cause from the wire, or "timeout", "unreachable", ...) and is tried again after
a backoff of 0.5 s doubling to 30 s; a ticket during the backoff fails at once naming the cause.
A reply from another engine than the ticket named fails the ticket's requests but leaves that key
unpoisoned (the addresses were the ticket's claim, not the engine's). Bounds, per consumer across
all engines: ``max_links`` links and ``max_handshake_sockets`` handshakes in flight, one ZeroMQ socket
each. To make room for a new engine the least recently used failed link goes first, else the least
recently used ready link the owner reports idle (``in_use``: no request, no pending decline); only when
every link is in use is the new engine refused (cause "capacity"). A link that goes (evicted, expired,
or its engine replaced by a newer incarnation once idle) takes its agents' PeerRecords with it, after
``on_drop`` (the owner says Bye), so ``records`` holds at most the agents of the links held.

Read transports (issue 28, engine/mapped/): with a secret, each request names this host and the mapping
kinds this rank can open; each source agent's transport is chosen once, when its link becomes ready
(``ReadTransports.attach``: its mapping from an authenticated reply, else NIXL) and kept in
``EngineLink.transports``. A newer incarnation of an engine invalidates the older one's mappings at once
(no copy from them after that, even while that link waits to go idle); a link that goes unmaps them.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

from hybrid_transfer.engine import auth, handshake, wire
from hybrid_transfer.engine.addresses import AllowedProducers, parse_address
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.mapped import ReadTransports
from hybrid_transfer.engine.peer_record import PeerRecord
from hybrid_transfer.engine.side_channel import Curve, HandshakeClient
from hybrid_transfer.errors import (
    ConfigError,
    EngineError,
    HandshakeError,
    HandshakeTimeout,
    HybridTransferError,
    WireDecodeError,
)
from hybrid_transfer.identity_enum import IdentityEnum
from hybrid_transfer.layout.fingerprint import Fingerprint
from hybrid_transfer.layout.model import ModelSpec
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor

log = logging.getLogger(__name__)

BACKOFF_FIRST_S = 0.5  # the wait after a link's first failure; it doubles with each failure in a row
BACKOFF_MAX_S = 30.0  # ... up to this; a failed link nobody asked for this long after its retry is forgotten
MISMATCH = "mismatch"  # the cause of a reply from another engine than the ticket named (never stored on a key)


class LinkState(IdentityEnum):
    HANDSHAKING = "handshaking"
    READY = "ready"
    FAILED = "failed"


@dataclass(eq=False)
class EngineLink:
    """One producer engine as this consumer rank sees it."""

    key: tuple[str, int] | None  # None until the first reply names the engine (connect by address)
    addresses: tuple[str, ...]  # every rank's side channel, index == tp_rank; () until known
    deadline: float
    state: LinkState = LinkState.HANDSHAKING
    replies: dict[int, wire.HandshakeReply] = field(default_factory=dict, repr=False)
    planner: Planner | None = field(default=None, repr=False)
    agents: dict[int, str] = field(default_factory=dict)  # producer rank -> NIXL agent name (sources only)
    keys: dict[int, bytes] = field(default_factory=dict, repr=False)  # producer rank -> link key (with a secret)
    error: HandshakeError | None = None
    merged_into: EngineLink | None = field(default=None, repr=False)
    cause: str = ""  # FAILED: the one-word cause (HandshakeError.cause)
    failures: int = 0  # failed handshakes of this engine in a row: the backoff doubles with each
    retry_at: float = 0.0  # FAILED: no new handshake before this (the owner's clock)
    transports: dict[int, str] = field(default_factory=dict)  # source rank -> "nixl", "shm" or "cuda_ipc"

    def resolve(self) -> EngineLink:
        link = self
        while link.merged_into is not None:
            link = link.merged_into
        return link


@dataclass
class LinkStats:
    failures: int = 0  # links that failed (each starts a backoff)
    retries: int = 0  # handshakes started again after a backoff
    evicted: int = 0  # links dropped to make room for a new one (max_links): failed ones, then idle ready ones
    evicted_ready: int = 0  # ... of them, idle ready links (their producers were told Bye)
    replaced: int = 0  # idle links of an engine dropped because a newer incarnation of it linked
    records_dropped: int = 0  # producer agents' PeerRecords dropped with their link
    expired: int = 0  # failed links forgotten BACKOFF_MAX_S after their retry time, nobody having asked


class Peers:
    """Links of one consumer rank; used only by the consumer's owner thread."""

    def __init__(self, agent: NixlAgent, model: ModelSpec, local: RankDescriptor, fingerprint: Fingerprint,
                 engine_id: str, clock: Callable[[], float], timeout_s: float, secret: bytes | None = None, *,
                 curve: Curve | None = None, allowed: AllowedProducers | None = None, max_links: int = 256,
                 max_sockets: int = 64, reads: ReadTransports | None = None, read_transport: str = "auto"):
        self._agent = agent
        self._model = model
        self._local = local
        self._digest = fingerprint.digest()
        self._fingerprint, self._engine_id = fingerprint, engine_id
        self._request = handshake.make_request(fingerprint, local, agent.name, engine_id)
        self._secret = secret
        self._reads = reads
        self._read_transport = read_transport
        # Mappings are asked for only with a secret: a producer offers them only after a proof (handshake.py).
        self._map = reads.request_fields() if reads is not None and secret is not None else {}
        self._nonces: dict[str, bytes] = {}  # address -> our client nonce of its handshake in progress
        self._proven: dict[str, tuple[bytes, str]] = {}  # address -> (server nonce, agent) of a checked challenge
        self.records: dict[str, PeerRecord] = {}  # producer agent name -> what we know of it (one record each)
        self._clock = clock
        self._timeout_s = timeout_s
        self._allowed = allowed
        self._max_links = max_links
        self._max_sockets = max_sockets
        self._client = HandshakeClient(curve, max_sockets=max_sockets)
        self._links: OrderedDict[tuple[str, int], EngineLink] = OrderedDict()  # least recently used first
        self._pending: dict[str, EngineLink] = {}  # address awaiting a reply -> its link
        self._replaced: set[tuple[str, int]] = set()  # keys of older incarnations, dropped once idle
        self.in_use: Callable[[], Collection[EngineLink]] = tuple  # set by the owner: links a request or decline needs
        self.on_drop: Callable[[EngineLink], None] = lambda link: None  # ... before a ready link's records go
        self.stats = LinkStats()

    @property
    def num_links(self) -> int:
        return len(self._links)

    @property
    def num_sockets(self) -> int:
        return self._client.num_sockets

    def links(self) -> list[EngineLink]:
        """Every link held, least recently used first."""
        return list(self._links.values())

    def find(self, key: tuple[str, int]) -> EngineLink | None:
        """The link of an engine, if any (nothing is started, nothing moves in the LRU order)."""
        return self._links.get(key)

    def allows(self, address: str) -> bool:
        """Whether this consumer may connect to ``address`` (EngineConfig.allowed_producers)."""
        return self._allowed is None or self._allowed.allows(address)

    def ensure(self, key: tuple[str, int], addresses: Sequence[str]) -> EngineLink:
        """The link of a ticket's engine, starting its handshakes when it is new (or its backoff is over).

        The caller has checked the addresses (syntax, allowed_producers). The link returned may
        already have FAILED, and its addresses may differ from ``addresses`` (an existing link).

        Raises:
            HandshakeError: the engine's link failed and its backoff is not over (naming the stored
                cause), or a bound is reached (cause "capacity"); nothing was connected.
        """
        now = self._clock()
        link = self._links.get(key)
        failures = 0
        if link is not None:
            self._links.move_to_end(key)
            if link.state is not LinkState.FAILED:
                return link
            if now < link.retry_at:
                raise self.error_of(link)
            failures = link.failures
        busy = [a for a in addresses if a in self._pending]
        if busy:  # another link waits for that address's reply: ours would take it from that link
            raise HandshakeError(f"a handshake with {busy[0]} is already in flight for another engine", cause="busy",
                                 address=busy[0], engine_key=key)
        if self._client.num_sockets + len(addresses) > self._max_sockets:
            raise HandshakeError(f"{self._client.num_sockets} handshakes are in flight; {len(addresses)} more would "
                                 f"pass max_handshake_sockets={self._max_sockets}", cause="capacity", engine_key=key)
        if link is not None:
            self._drop(key)
            self.stats.retries += 1
        else:
            self._make_room(key)
        link = EngineLink(key=key, addresses=tuple(addresses), deadline=now + self._timeout_s, failures=failures)
        self._links[key] = link
        for address in link.addresses:
            self._send(link, address)
        return link

    def connect(self, address: str) -> EngineLink:
        """Start a handshake with the engine of one rank's ``address``; the reply names the other ranks.

        Raises:
            HandshakeError: a malformed or not allowed address (cause "unreachable" / "disallowed"),
                the engine's backoff is not over, or max_handshake_sockets are in flight.
        """
        try:
            parse_address(address)
        except ConfigError as exc:
            raise HandshakeError(str(exc), cause="unreachable") from None
        if not self.allows(address):
            raise HandshakeError(f"{address} is not in EngineConfig.allowed_producers", cause="disallowed")
        now = self._clock()
        for link in self._links.values():
            if address in link.addresses and (link.state is not LinkState.FAILED or now < link.retry_at):
                return link
        pending = self._pending.get(address)
        if pending is not None:
            return pending.resolve()
        link = EngineLink(key=None, addresses=(), deadline=now + self._timeout_s)
        self._send(link, address)
        return link

    def error_of(self, link: EngineLink) -> HandshakeError:
        """A fresh error for a failed link: its stored error (same type and values) naming the cause and
        when the next handshake may start (one stored instance, raised many times)."""
        link = link.resolve()
        error = link.error or HandshakeError("link failed", cause=link.cause)
        wait = max(0.0, link.retry_at - self._clock())
        fresh = HandshakeError.__new__(type(error))
        fresh.__dict__.update(error.__dict__)
        fresh.cause = link.cause or error.cause
        fresh.args = (f"{error} [cause: {fresh.cause}; next handshake in {wait:.1f} s]",)
        fresh.__cause__ = error
        return fresh

    def progress(self, timeout_ms: int = 0) -> None:
        """Take in every reply that has arrived, then fail links past their deadline."""
        for address, data in self._client.receive(timeout_ms):
            link = self._pending.pop(address, None)
            self._client.drop([address])
            if link is not None and link.state is LinkState.HANDSHAKING:
                self._on_reply(link, address, data)
        now = self._clock()
        for address, link in list(self._pending.items()):
            if link.state is LinkState.HANDSHAKING and now >= link.deadline:
                self._fail(link, HandshakeTimeout(address=address, timeout_s=self._timeout_s))
        for key, link in list(self._links.items()):
            if link.state is LinkState.FAILED and now >= link.retry_at + BACKOFF_MAX_S:
                self._drop(key)
                self.stats.expired += 1
        busy = self.in_use() if self._replaced else ()
        for key in list(self._replaced):
            link = self._links.get(key)
            if link is None:
                self._replaced.discard(key)
            elif link not in busy:
                self._replaced.discard(key)
                self._drop(key)
                self.stats.replaced += 1

    def _make_room(self, key: tuple[str, int]) -> None:
        """Evict the least recently used failed link when max_links are held, else the least recently used
        ready link not in use.

        Raises:
            HandshakeError: every link held is handshaking or in use (cause "capacity").
        """
        if len(self._links) < self._max_links:
            return
        victim = next((k for k, link in self._links.items() if link.state is LinkState.FAILED), None)
        if victim is None:
            busy = self.in_use()
            victim = next((k for k, link in self._links.items()
                           if link.state is LinkState.READY and link not in busy), None)
        if victim is None:
            raise HandshakeError(f"this consumer holds max_links={self._max_links} links to producer engines, each "
                                 "handshaking or in use by a request or decline", cause="capacity", engine_key=key)
        if self._links[victim].state is LinkState.READY:
            self.stats.evicted_ready += 1
            log.info("consumer %s: idle link to producer engine %s evicted for %s (max_links=%d)",
                     self._agent.name, victim, key, self._max_links)
        self._drop(victim)
        self.stats.evicted += 1

    def _drop(self, key: tuple[str, int]) -> None:
        """Forget a link and its agents' records (a ready one's producers are told Bye first, ``on_drop``)."""
        link = self._links.pop(key)
        self._replaced.discard(key)
        if link.state is LinkState.READY:
            self.on_drop(link)
        if self._reads is not None:
            for name in link.agents.values():
                self._reads.detach(name)
        for name in link.agents.values():
            if self.records.pop(name, None) is not None:
                self.stats.records_dropped += 1

    def _send(self, link: EngineLink, address: str) -> None:
        if link.state is LinkState.FAILED:
            return
        self._pending[address] = link
        self._proven.pop(address, None)
        if self._secret is None:
            payload = self._request
        else:
            cn = self._nonces[address] = auth.new_nonce()
            payload = handshake.make_request(self._fingerprint, self._local, self._agent.name, self._engine_id,
                                             client_nonce=cn, **self._map)
        try:
            self._client.send(address, payload)
        except HandshakeError as exc:
            self._fail(link, exc)

    def _answer_challenge(self, link: EngineLink, address: str, challenge: wire.AuthChallenge) -> None:
        """Check the producer's proof, then send ours (the same request with both nonces)."""
        cn = self._nonces.get(address)
        if self._secret is None:
            raise HandshakeError("the producer requires authentication: set the same shared secret here "
                                 f"(${auth.SECRET_ENV} or EngineConfig.secret_file)", address=address, cause="secret")
        if cn is None or address in self._proven or not auth.same(challenge.proof, auth.proof(
                self._secret, "producer", cn, challenge.server_nonce, challenge.agent_name, self._agent.name)):
            raise HandshakeError("the producer failed to prove the shared secret (another secret, or not our "
                                 "producer)", address=address, cause="secret")
        self._proven[address] = (challenge.server_nonce, challenge.agent_name)
        mine = auth.proof(self._secret, "consumer", cn, challenge.server_nonce, challenge.agent_name,
                          self._agent.name)
        self._pending[address] = link
        self._client.send(address, handshake.make_request(self._fingerprint, self._local, self._agent.name,
                                                          self._engine_id, client_nonce=cn,
                                                          server_nonce=challenge.server_nonce, proof=mine,
                                                          **self._map))

    def _link_key(self, address: str, reply: wire.HandshakeReply) -> bytes | None:
        """The link key of an accepted reply (None without a secret).

        Raises:
            HandshakeError: we have a secret, but the producer accepted without proving it.
        """
        if self._secret is None:
            return None
        cn, proven = self._nonces.pop(address, None), self._proven.pop(address, None)
        if cn is None or proven is None or proven[1] != reply.agent_name:
            raise HandshakeError("the producer accepted without proving the shared secret (it has none, or "
                                 "is not our producer): refused", address=address, cause="secret")
        return auth.link_key(self._secret, cn, proven[0], reply.agent_name, self._agent.name)

    def _on_reply(self, link: EngineLink, address: str, data: bytes) -> None:
        try:
            try:
                reply = handshake.read_reply(data, address=address, digest=self._digest)
            except HandshakeError as exc:
                exc.cause = exc.cause or _refusal_cause(data)
                raise
            if isinstance(reply, wire.AuthChallenge):
                self._answer_challenge(link, address, reply)
                return
            key = self._link_key(address, reply)
            link = self._place(link, address, reply)
            if link is not None and key is not None:
                link.keys[reply.rank.tp_rank] = key
            if link is not None and len(link.replies) == len(link.addresses):
                self._finish(link)
        except HandshakeError as exc:
            self._fail(link, exc)
        except EngineError as exc:
            self._fail(link, HandshakeError(f"cannot load the producer's agent metadata: {exc}", address=address,
                                            cause="protocol"))

    def _place(self, link: EngineLink, address: str, reply: wire.HandshakeReply) -> EngineLink | None:
        """Record one rank's reply in its link (naming a connect-by-address link on its first reply)."""
        if reply.rank is None:
            raise HandshakeError("accepted reply without a rank descriptor", address=address, cause="protocol")
        key = (reply.engine_id, reply.incarnation)
        rank, tp = reply.rank.tp_rank, reply.rank.tp_size
        if link.key is None:
            if len(reply.engine_addresses) != tp:
                raise HandshakeError(f"producer lists {len(reply.engine_addresses)} rank addresses for TP {tp} "
                                     "(set_engine_addresses was not called?)", address=address, cause="protocol")
            existing = self._links.get(key)
            if existing is not None and existing.state is not LinkState.FAILED:
                link.merged_into = existing
                link = existing
                if rank in link.replies:
                    return None
            else:
                self._adopt(link, key, reply.engine_addresses, rank, existing)
        if key != link.key:
            raise HandshakeError(f"rank answered as engine {key}, the ticket names {link.key} "
                                 "(a restarted producer, or a ticket naming another engine's addresses)",
                                 address=address, cause=MISMATCH)
        if tp != len(link.addresses):
            raise HandshakeError(f"rank {rank} reports TP {tp}, the ticket lists {len(link.addresses)} ranks",
                                 address=address, cause="incompatible")
        link.replies[rank] = reply
        return link

    def _adopt(self, link: EngineLink, key: tuple[str, int], addresses: tuple[str, ...], rank: int,
               failed: EngineLink | None) -> None:
        """A connect-by-address link learns its engine from the first reply and asks the other ranks."""
        others = [a for r, a in enumerate(addresses) if r != rank]
        for other in others:
            if not self.allows(other):
                raise HandshakeError(f"the producer names rank address {other}, which is not in "
                                     "EngineConfig.allowed_producers", address=other, cause="disallowed")
        if self._client.num_sockets + len(others) > self._max_sockets:
            raise HandshakeError(f"{len(others)} more handshakes would pass max_handshake_sockets="
                                 f"{self._max_sockets}", cause="capacity")
        if failed is not None:
            link.failures = failed.failures
            self._drop(key)
        else:
            self._make_room(key)
        link.key, link.addresses = key, addresses
        self._links[key] = link
        for other in others:
            self._send(link, other)

    def _finish(self, link: EngineLink) -> None:
        remotes = [link.replies[r].rank for r in range(len(link.addresses))]
        try:
            planner = Planner(self._model, self._local, remotes)  # type: ignore[arg-type]
        except HybridTransferError as exc:
            raise HandshakeError(f"cannot plan reads from this engine: {exc}", address=link.addresses[0],
                                 differences=getattr(exc, "differences", ()), cause="incompatible") from exc
        for source in planner.topology.sources:
            reply = link.replies[source]
            name = self._agent.add_remote(reply.agent_metadata)
            if name != reply.agent_name:
                raise HandshakeError(f"metadata names agent {name!r}, the reply {reply.agent_name!r}",
                                     address=link.addresses[source], cause="protocol")
            link.agents[source] = name
            key = link.keys.get(source)
            # A new handshake with an agent (after a timeout) starts a new record: a new key, a new Hello.
            self.records[name] = PeerRecord(name, auth.Link.for_consumer(key) if key is not None else None,
                                            since=self._clock())
            link.transports[source] = self._transport(link, source, name, reply, key is not None)
        link.planner = planner
        link.state = LinkState.READY
        link.failures = 0
        engine_id, incarnation = link.key
        self._replaced.update(k for k in self._links if k[0] == engine_id and k[1] != incarnation)
        if self._reads is not None:  # an older incarnation's mappings: no copy from them from now on
            for k in self._replaced:
                for name in self._links[k].agents.values() if k in self._links else ():
                    self._reads.invalidate(name, f"producer engine {engine_id} restarted (incarnation {incarnation})")
        log.info("consumer %s linked to producer engine %s (TP %d)", self._agent.name, link.key,
                 len(link.addresses))

    def _transport(self, link: EngineLink, source: int, name: str, reply: wire.HandshakeReply,
                   authenticated: bool) -> str:
        """The transport of one source agent's READs (module docstring); raises when "mapped" is required."""
        if self._reads is None:
            return "nixl"
        rank = reply.rank
        expected = [(a, rank.region_bytes) for a in rank.tensor_addrs]
        chosen = self._reads.attach(name, reply.mapping if authenticated else None, expected)
        if chosen == "nixl" and self._read_transport == "mapped":
            raise HandshakeError(f"read_transport='mapped', but producer agent {name} cannot be mapped from here "
                                 "(another host, no shared secret, or a cache that is not shareable)",
                                 address=link.addresses[source], cause="incompatible")
        return chosen

    def _fail(self, link: EngineLink, error: HandshakeError) -> None:
        link = link.resolve()
        if link.state is LinkState.FAILED:
            return
        link.state = LinkState.FAILED
        link.error = error
        link.cause = error.cause or "unreachable"
        link.failures += 1
        # A refusal for incompatibility cannot heal within one incarnation (its geometry is fixed): no point
        # asking again sooner than the longest backoff.
        delay = BACKOFF_MAX_S if link.cause == "incompatible" else BACKOFF_FIRST_S * 2 ** min(link.failures - 1, 16)
        link.retry_at = self._clock() + min(delay, BACKOFF_MAX_S)
        self.stats.failures += 1
        if link.key is None and error.engine_key is not None and error.engine_key[0]:  # (a pre-auth refusal names none)
            # A refusal names its engine: later tickets for it fail at once (until the backoff is over).
            existing = self._links.get(error.engine_key)
            if (existing is not None and existing.state is LinkState.FAILED) or (
                    existing is None and self._has_room()):
                link.key = error.engine_key
                self._links[link.key] = link
        if link.cause == MISMATCH and link.key is not None and self._links.get(link.key) is link:
            del self._links[link.key]  # the ticket named this key with another engine's addresses: not its failure
        stale = [a for a, pending in self._pending.items() if pending is link]
        for address in stale:
            del self._pending[address]
            self._nonces.pop(address, None)
            self._proven.pop(address, None)
        self._client.drop(stale)
        log.warning("consumer %s: %s (cause %s; next handshake in %.1f s)", self._agent.name, error, link.cause,
                    link.retry_at - self._clock())

    def _has_room(self) -> bool:
        """Room for one more link, evicting the least recently used failed one if need be (never a ready one:
        a failure's record is not worth an idle link)."""
        if len(self._links) < self._max_links:
            return True
        victim = next((k for k, link in self._links.items() if link.state is LinkState.FAILED), None)
        if victim is None:
            return False
        self._drop(victim)
        self.stats.evicted += 1
        return True

    def close(self) -> None:
        self._client.close()


def _refusal_cause(data: bytes) -> str:
    """The producer's one-word cause in a refusal (wire version 7), else "refused"; "protocol" for other bytes."""
    try:
        _, body = wire.decode(data)
    except WireDecodeError:
        return "protocol"
    if isinstance(body, wire.HandshakeReply) and not body.accepted:
        if body.cause in wire.REFUSAL_CAUSES:
            return body.cause
        return "incompatible" if body.differences else "refused"
    return "protocol"
