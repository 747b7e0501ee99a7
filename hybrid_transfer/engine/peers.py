"""A consumer rank's links to producer engines: handshakes with every rank, then a cached Planner.

A link is keyed by the producer engine's (engine_id, incarnation), so a restarted
producer (new incarnation) is a new link. Handshakes are non-blocking: replies are
picked up by ``progress()``, which the consumer calls from its own poll().

With a shared secret (engine/auth.py) each rank's handshake takes two round trips: the producer's
challenge proves it knows the secret (before anything of ours is trusted), our second request
proves we do, and both sides derive the link key. A producer that accepts without a challenge is
refused: no downgrade. Each producer agent gets one PeerRecord (peer_record.py) in ``records``.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from hybrid_transfer.engine import auth, handshake, wire
from hybrid_transfer.engine.agent import NixlAgent
from hybrid_transfer.engine.peer_record import PeerRecord
from hybrid_transfer.engine.side_channel import Curve, HandshakeClient
from hybrid_transfer.errors import EngineError, HandshakeError, HandshakeTimeout, HybridTransferError
from hybrid_transfer.layout.fingerprint import Fingerprint
from hybrid_transfer.layout.model import ModelSpec
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor

log = logging.getLogger(__name__)


class LinkState(enum.Enum):
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
    replies: dict[int, wire.HandshakeReply] = field(default_factory=dict)
    planner: Planner | None = None
    agents: dict[int, str] = field(default_factory=dict)  # producer rank -> NIXL agent name (sources only)
    keys: dict[int, bytes] = field(default_factory=dict, repr=False)  # producer rank -> link key (with a secret)
    error: HandshakeError | None = None
    merged_into: EngineLink | None = None

    def resolve(self) -> EngineLink:
        link = self
        while link.merged_into is not None:
            link = link.merged_into
        return link


class Peers:
    """Links of one consumer rank; used only by the consumer's owner thread."""

    def __init__(self, agent: NixlAgent, model: ModelSpec, local: RankDescriptor, fingerprint: Fingerprint,
                 engine_id: str, clock: Callable[[], float], timeout_s: float, secret: bytes | None = None, *,
                 curve: Curve | None = None):
        self._agent = agent
        self._model = model
        self._local = local
        self._digest = fingerprint.digest()
        self._fingerprint, self._engine_id = fingerprint, engine_id
        self._request = handshake.make_request(fingerprint, local, agent.name, engine_id)
        self._secret = secret
        self._nonces: dict[str, bytes] = {}  # address -> our client nonce of its handshake in progress
        self._proven: dict[str, tuple[bytes, str]] = {}  # address -> (server nonce, agent) of a checked challenge
        self.records: dict[str, PeerRecord] = {}  # producer agent name -> what we know of it (one record each)
        self._clock = clock
        self._timeout_s = timeout_s
        self._client = HandshakeClient(curve)
        self._links: dict[tuple[str, int], EngineLink] = {}
        self._pending: dict[str, EngineLink] = {}  # address awaiting a reply -> its link

    def ensure(self, key: tuple[str, int], addresses: Sequence[str]) -> EngineLink:
        """The link of a ticket's engine, starting its handshakes when it is new."""
        link = self._links.get(key)
        if link is None:
            link = EngineLink(key=key, addresses=tuple(addresses), deadline=self._clock() + self._timeout_s)
            self._links[key] = link
            for address in link.addresses:
                self._send(link, address)
        return link

    def connect(self, address: str) -> EngineLink:
        """Start a handshake with the engine of one rank's ``address``; the reply names the other ranks."""
        for link in self._links.values():
            if address in link.addresses:
                return link
        pending = self._pending.get(address)
        if pending is not None:
            return pending.resolve()
        link = EngineLink(key=None, addresses=(), deadline=self._clock() + self._timeout_s)
        self._send(link, address)
        return link

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

    def _send(self, link: EngineLink, address: str) -> None:
        self._pending[address] = link
        self._proven.pop(address, None)
        if self._secret is None:
            self._client.send(address, self._request)
            return
        cn = self._nonces[address] = auth.new_nonce()
        self._client.send(address, handshake.make_request(self._fingerprint, self._local, self._agent.name,
                                                          self._engine_id, client_nonce=cn))

    def _answer_challenge(self, link: EngineLink, address: str, challenge: wire.AuthChallenge) -> None:
        """Check the producer's proof, then send ours (the same request with both nonces)."""
        cn = self._nonces.get(address)
        if self._secret is None:
            raise HandshakeError("the producer requires authentication: set the same shared secret here "
                                 f"(${auth.SECRET_ENV} or EngineConfig.secret_file)", address=address)
        if cn is None or address in self._proven or not auth.same(challenge.proof, auth.proof(
                self._secret, "producer", cn, challenge.server_nonce, challenge.agent_name, self._agent.name)):
            raise HandshakeError("the producer failed to prove the shared secret (another secret, or not our "
                                 "producer)", address=address)
        self._proven[address] = (challenge.server_nonce, challenge.agent_name)
        mine = auth.proof(self._secret, "consumer", cn, challenge.server_nonce, challenge.agent_name,
                          self._agent.name)
        self._pending[address] = link
        self._client.send(address, handshake.make_request(self._fingerprint, self._local, self._agent.name,
                                                          self._engine_id, client_nonce=cn,
                                                          server_nonce=challenge.server_nonce, proof=mine))

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
                                 "is not our producer): refused", address=address)
        return auth.link_key(self._secret, cn, proven[0], reply.agent_name, self._agent.name)

    def _on_reply(self, link: EngineLink, address: str, data: bytes) -> None:
        try:
            reply = handshake.read_reply(data, address=address, digest=self._digest)
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
            self._fail(link, HandshakeError(f"cannot load the producer's agent metadata: {exc}", address=address))

    def _place(self, link: EngineLink, address: str, reply: wire.HandshakeReply) -> EngineLink | None:
        """Record one rank's reply in its link (naming a connect-by-address link on its first reply)."""
        if reply.rank is None:
            raise HandshakeError("accepted reply without a rank descriptor", address=address)
        key = (reply.engine_id, reply.incarnation)
        rank, tp = reply.rank.tp_rank, reply.rank.tp_size
        if link.key is None:
            if len(reply.engine_addresses) != tp:
                raise HandshakeError(f"producer lists {len(reply.engine_addresses)} rank addresses for TP {tp} "
                                     "(set_engine_addresses was not called?)", address=address)
            existing = self._links.get(key)
            if existing is not None:
                link.merged_into = existing
                link = existing
                if rank in link.replies:
                    return None
            else:
                link.key, link.addresses = key, reply.engine_addresses
                self._links[key] = link
                for r, other in enumerate(link.addresses):
                    if r != rank:
                        self._send(link, other)
        if key != link.key:
            raise HandshakeError(f"rank answered as engine {key}, the ticket names {link.key} "
                                 "(a restarted producer?)", address=address)
        if tp != len(link.addresses):
            raise HandshakeError(f"rank {rank} reports TP {tp}, the ticket lists {len(link.addresses)} ranks",
                                 address=address)
        link.replies[rank] = reply
        return link

    def _finish(self, link: EngineLink) -> None:
        remotes = [link.replies[r].rank for r in range(len(link.addresses))]
        try:
            planner = Planner(self._model, self._local, remotes)  # type: ignore[arg-type]
        except HybridTransferError as exc:
            raise HandshakeError(f"cannot plan reads from this engine: {exc}", address=link.addresses[0],
                                 differences=getattr(exc, "differences", ())) from exc
        for source in planner.topology.sources:
            reply = link.replies[source]
            name = self._agent.add_remote(reply.agent_metadata)
            if name != reply.agent_name:
                raise HandshakeError(f"metadata names agent {name!r}, the reply {reply.agent_name!r}",
                                     address=link.addresses[source])
            link.agents[source] = name
            key = link.keys.get(source)
            # A new handshake with an agent (after a timeout) starts a new record: a new key, a new Hello.
            self.records[name] = PeerRecord(name, auth.Link.for_consumer(key) if key is not None else None,
                                            since=self._clock())
        link.planner = planner
        link.state = LinkState.READY
        log.info("consumer %s linked to producer engine %s (TP %d)", self._agent.name, link.key,
                 len(link.addresses))

    def _fail(self, link: EngineLink, error: HandshakeError) -> None:
        link = link.resolve()
        link.state = LinkState.FAILED
        link.error = error
        if link.key is None and error.engine_key is not None:
            # A refusal names its engine: later tickets for it fail at once instead of asking again.
            link.key = error.engine_key
            self._links.setdefault(link.key, link)
        stale = [a for a, pending in self._pending.items() if pending is link]
        for address in stale:
            del self._pending[address]
            self._nonces.pop(address, None)
            self._proven.pop(address, None)
        self._client.drop(stale)
        if isinstance(error, HandshakeTimeout) and link.key is not None:
            self._links.pop(link.key, None)  # a timeout may heal: the next ticket tries afresh
        log.warning("consumer %s: %s", self._agent.name, error)

    def close(self) -> None:
        self._client.close()
