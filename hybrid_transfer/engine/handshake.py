"""The handshake's meaning, both sides, without sockets (docs/wire.md#handshake: two tiers).

Tier one, equal fields: the two Fingerprints (model dimensions, dtypes, layouts,
N-1 rule, layer-to-tensor map) must match; a refusal lists every differing field
with both values. Tier two, compatible geometry: TP sizes, block sizes and
addresses only need to map onto each other; the producer checks what it can see
(the consumer's descriptor against its own arithmetic, the TP pair), the consumer
builds its Planner over every producer rank, which rejects what it cannot map.

With a shared secret (engine/auth.py) a producer answers nothing but a challenge until the
consumer has proven the secret: a refusal then names no engine and no field, and the accepted
reply (agent metadata, region addresses) goes only to a consumer whose proof checked.

The mapped path (wire version 11, engine/mapped/): a card built with a ``mapping`` (the producer has a
secret) keeps a second accepted reply that carries it; ``answer`` sends that one only after the consumer
proved the secret, and only when the request names this host's key and a kind the offer is of.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import msgspec

from hybrid_transfer.engine import auth, wire
from hybrid_transfer.errors import HandshakeError, PlanError, WireDecodeError
from hybrid_transfer.layout.fingerprint import Fingerprint, fingerprint_diff
from hybrid_transfer.layout.model import ModelSpec
from hybrid_transfer.plan.rank import RankDescriptor, geometry_from_descriptor
from hybrid_transfer.plan.topology import Topology

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProducerCard:
    """Everything a producer rank tells consumers; immutable, so the listener thread may read it freely."""

    model: ModelSpec
    fingerprint: Fingerprint
    rank: RankDescriptor
    agent_name: str
    agent_metadata: bytes
    engine_id: str
    incarnation: int
    engine_addresses: tuple[str, ...]
    mapping: wire.MapOffer | None = field(default=None, repr=False)  # only a card of a rank with a secret
    digest: str = field(init=False)
    accepted_reply: bytes = field(init=False)  # the same bytes for every compatible consumer
    mapped_reply: bytes = field(init=False, repr=False)  # ... with the mapping, for an authenticated one on our host

    def __post_init__(self) -> None:
        digest = self.fingerprint.digest()
        reply = wire.HandshakeReply(
            accepted=True, engine_id=self.engine_id, incarnation=self.incarnation,
            engine_addresses=self.engine_addresses, agent_name=self.agent_name,
            agent_metadata=self.agent_metadata, rank=self.rank,
        )
        object.__setattr__(self, "digest", digest)
        object.__setattr__(self, "accepted_reply", wire.encode(reply, digest))
        mapped = b"" if self.mapping is None else wire.encode(msgspec.structs.replace(reply, mapping=self.mapping),
                                                              digest)
        object.__setattr__(self, "mapped_reply", mapped)

    def reply_for(self, request: wire.HandshakeRequest, authenticated: bool) -> bytes:
        """The accepted reply for ``request``: with the mapping only when authenticated, same host, same kind."""
        m = self.mapping
        if (authenticated and m is not None and m.host and request.map_host == m.host
                and m.kind in request.map_kinds):
            return self.mapped_reply
        return self.accepted_reply


@dataclass
class ListenerStats:
    """Counters written only by the listener thread (single writer; readers may see them lag)."""

    accepted: int = 0
    rejected: int = 0  # refusals, every cause (``causes`` splits them)
    garbage: int = 0
    causes: Counter[str] = field(default_factory=Counter)  # refusals by wire.REFUSAL_CAUSES word

    def refused(self, cause: str) -> None:
        self.rejected += 1
        self.causes[cause] += 1


@dataclass
class ListenerAuth:
    """What the listener needs to authenticate consumers (None when no secret is set), and its counters."""

    secret: bytes = field(repr=False)
    challenges: auth.Challenges = field(repr=False)
    challenged: int = 0  # first requests answered with a challenge (nothing is stored for them: auth.Challenges)
    unauthenticated: int = 0  # requests refused for a missing or wrong proof (also counted as rejected)
    stale: int = 0  # proofs over a challenge older than the deadline (refused with cause "busy": retry)
    replayed: int = 0  # proofs of an exchange already accepted (refused with cause "secret")


def answer(card: ProducerCard, data: bytes, stats: ListenerStats, on_accept: Callable[..., None],
           secured: ListenerAuth | None = None) -> bytes:
    """The producer listener's reply to one message; never raises on peer bytes.

    ``on_accept(consumer_agent_name)`` (with a secret: ``on_accept(consumer_agent_name, link_key)``)
    runs before the reply is sent, so the owner knows the agent (and its link key) by the time
    that agent can notify.
    """
    try:
        _, request = wire.decode(data, wire.Kind.HANDSHAKE_REQUEST)
    except WireDecodeError as exc:
        stats.garbage += 1
        log.info("handshake listener of %s: undecodable message: %s", card.agent_name, exc)
        return wire.encode(wire.ErrorReply(reason=str(exc)), card.digest)
    request = cast(wire.HandshakeRequest, request)  # decode() checked the kind
    key = None
    if secured is not None:
        key, instead = _authenticate(card, request, stats, secured)
        if key is None:
            return instead  # a challenge or a refusal
    diffs = fingerprint_diff(request.fingerprint, card.fingerprint)  # (field, consumer, producer)
    error = "fields that must be equal differ" if diffs else _incompatible(card, request.rank)
    if error:
        stats.refused("incompatible")
        reply = wire.HandshakeReply(
            accepted=False, error=f"refused (incompatible): {error}", engine_id=card.engine_id,
            incarnation=card.incarnation, differences=tuple(wire.FieldDifference(name, c, p) for name, c, p in diffs),
            cause="incompatible",
        )
        return wire.encode(reply, card.digest)
    if key is None:
        on_accept(request.agent_name)
    else:
        on_accept(request.agent_name, key)
    stats.accepted += 1
    return card.reply_for(request, authenticated=key is not None)


def _authenticate(card: ProducerCard, request: wire.HandshakeRequest, stats: ListenerStats,
                  secured: ListenerAuth) -> tuple[bytes | None, bytes]:
    """(the link key, b"") when the request proves the secret; else (None, the reply to send instead).

    Nothing is stored before a proof checks (auth.Challenges): a first request costs the listener two MACs.
    """
    cn = request.client_nonce
    if len(cn) != auth.NONCE_BYTES:
        secured.unauthenticated += 1
        return None, _refusal(card, stats, "secret", "this producer requires authentication: set the same shared secret "
                              f"on the consumer (${auth.SECRET_ENV} or EngineConfig.secret_file)")
    if not request.proof:
        secured.challenged += 1
        sn = secured.challenges.issue(request.agent_name, cn)
        mine = auth.proof(secured.secret, "producer", cn, sn, card.agent_name, request.agent_name)
        return None, wire.encode(wire.AuthChallenge(server_nonce=sn, proof=mine, agent_name=card.agent_name),
                                 card.digest)
    sn = request.server_nonce
    verdict = secured.challenges.check(request.agent_name, cn, sn)
    if verdict is auth.Verdict.FRESH:
        expected = auth.proof(secured.secret, "consumer", cn, sn, card.agent_name, request.agent_name)
        if not auth.same(expected, request.proof):
            verdict = auth.Verdict.FORGED
        else:  # recorded only now, after the proof: the record of accepted exchanges refuses a replay
            verdict = secured.challenges.take(request.agent_name, cn, sn)
    if verdict is auth.Verdict.FRESH:
        return auth.link_key(secured.secret, cn, sn, card.agent_name, request.agent_name), b""
    if verdict is auth.Verdict.STALE:
        secured.stale += 1
        return None, _refusal(card, stats, "busy", "the challenge expired before its proof arrived (the producer waits "
                              "handshake_timeout_s): handshake again")
    if verdict is auth.Verdict.FULL:
        return None, _refusal(card, stats, "capacity", "too many handshakes accepted within handshake_timeout_s: "
                              "handshake again later")
    secured.unauthenticated += 1
    if verdict is auth.Verdict.REPLAYED:
        secured.replayed += 1
        return None, _refusal(card, stats, "secret", "authentication failed: this exchange was already accepted (a replay)")
    return None, _refusal(card, stats, "secret", "authentication failed: wrong shared secret, or a challenge this "
                          "producer did not issue")


def _refusal(card: ProducerCard, stats: ListenerStats, cause: str, error: str) -> bytes:
    """A refusal before authentication, counted by cause: it names no engine, incarnation or field."""
    stats.refused(cause)
    reply = wire.HandshakeReply(accepted=False, error=f"refused ({cause}): {error}", cause=cause)
    return wire.encode(reply, card.digest)


def _incompatible(card: ProducerCard, consumer: RankDescriptor) -> str:
    """Tier two as far as the producer can judge it; '' when compatible."""
    try:
        geometry_from_descriptor(card.model, consumer)
        Topology(prefill_tp=card.rank.tp_size, decode_tp=consumer.tp_size, decode_rank=consumer.tp_rank)
    except (PlanError, ValueError) as exc:
        return f"incompatible consumer geometry: {exc}"
    return ""


def make_request(fingerprint: Fingerprint, rank: RankDescriptor, agent_name: str, engine_id: str, *,
                 client_nonce: bytes = b"", server_nonce: bytes = b"", proof: bytes = b"", map_host: str = "",
                 map_kinds: tuple[str, ...] = ()) -> bytes:
    body = wire.HandshakeRequest(fingerprint=fingerprint, rank=rank, agent_name=agent_name, engine_id=engine_id,
                                 client_nonce=client_nonce, server_nonce=server_nonce, proof=proof,
                                 map_host=map_host, map_kinds=tuple(map_kinds))
    return wire.encode(body, fingerprint.digest())


def read_reply(data: bytes, *, address: str, digest: str) -> wire.HandshakeReply | wire.AuthChallenge:
    """The consumer's reading of a producer rank's reply (a challenge when the producer has a secret).

    Raises:
        HandshakeError: a refusal (with ``differences``, and ``cause`` the producer's word from
            wire.REFUSAL_CAUSES), or, with cause "protocol", a reply that does not decode or an
            accepted reply whose fingerprint digest is not ours.
    """
    try:
        env, body = wire.decode(data)
    except WireDecodeError as exc:
        raise HandshakeError(f"undecodable reply: {exc}", address=address, cause="protocol") from exc
    if isinstance(body, wire.AuthChallenge):
        return body
    if isinstance(body, wire.ErrorReply):
        raise HandshakeError(f"the producer could not read our request: {body.reason}", address=address,
                             cause="protocol")
    if not isinstance(body, wire.HandshakeReply):
        raise HandshakeError(f"expected a handshake reply, got {env.kind.name}", address=address, cause="protocol")
    if not body.accepted:
        cause = body.cause if body.cause in wire.REFUSAL_CAUSES else ""
        raise HandshakeError(body.error, address=address, engine_key=(body.engine_id, body.incarnation),
                             differences=[(d.field, d.consumer, d.producer) for d in body.differences], cause=cause)
    if env.fingerprint != digest or body.rank is None or not body.agent_metadata:
        raise HandshakeError(f"accepted reply is inconsistent (fingerprint {env.fingerprint!r}, ours {digest!r})",
                             address=address, cause="protocol")
    return body
