"""Tickets issued outside the Producer: by a serving engine's scheduler, from what its ranks published.

In an engine such as vLLM the scheduler process must return a request's ticket synchronously,
before any worker has run ``hold()``. Each producer rank publishes a ``RankCard`` once (its
side-channel address, identity and cache sizes); the scheduler gathers them into an
``EngineCard`` and issues tickets with ``issue_ticket``, a pure function (no NIXL, no sockets).
Every rank then holds the request with that ticket, and ``Producer.hold(..., ticket=...)``
refuses it when the rank's own view differs, before pinning anything.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from hybrid_transfer.engine import claims, wire
from hybrid_transfer.errors import ConfigError, EngineCardError, WireDecodeError
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.plan.validate import block_id_arrays, validate_block_ids

NONCE_LIMIT = 1 << 63  # nonces are drawn in [0, 2**63): they fit a signed 64-bit integer everywhere


class RankCard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What one producer rank publishes to its engine's scheduler (``Producer.rank_card``).

    ``address`` is the side-channel address the rank actually bound (a configured port 0 is
    resolved here). ``group_kinds``: the kind of each cache group, in this library's group order.
    """

    engine_id: str
    incarnation: int
    tp_rank: int
    tp_size: int
    address: str
    lease_s: float
    block_size: int
    num_blocks: int
    group_kinds: tuple[LayerKind, ...]
    fingerprint: str  # Fingerprint.digest() of the rank's geometry
    agent_name: str = ""


# Fields every rank of one engine must report with the same value.
_SHARED_FIELDS = ("engine_id", "incarnation", "tp_size", "lease_s", "block_size", "num_blocks", "group_kinds",
                  "fingerprint")


class EngineCard(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything a scheduler process knows of one producer engine: enough to issue its tickets."""

    engine_id: str
    incarnation: int
    tp_size: int
    addresses: tuple[str, ...]  # side-channel address of every rank, index == tp_rank
    lease_s: float
    block_size: int
    num_blocks: int
    group_kinds: tuple[LayerKind, ...]
    fingerprint: str

    @property
    def engine_key(self) -> tuple[str, int]:
        return (self.engine_id, self.incarnation)

    @classmethod
    def from_ranks(cls, ranks: Mapping[int, RankCard] | Iterable[RankCard]) -> EngineCard:
        """Gather every rank's card (a mapping keyed by tp_rank, as engines hand them over, or a list).

        Raises:
            EngineCardError: no card, a card that is not a RankCard, a rank missing, listed twice or
                out of range, a mapping key that is not the card's rank, two ranks with one address,
                or a field every rank must share that differs (``field`` names it, ``ranks`` the
                ranks that disagree with rank 0's value).
        """
        if isinstance(ranks, Mapping):
            for key, card in ranks.items():
                if isinstance(card, RankCard) and isinstance(key, int) and key != card.tp_rank:
                    raise EngineCardError(f"card for rank {card.tp_rank} is keyed as rank {key}", field="tp_rank",
                                          value=key, ranks=(key, card.tp_rank))
            cards = list(ranks.values())
        else:
            cards = list(ranks)
        if not cards:
            raise EngineCardError("no rank cards given", field="ranks", value=0)
        for card in cards:
            if not isinstance(card, RankCard):
                raise EngineCardError(f"expected RankCard, got {type(card).__name__}", field="ranks",
                                      value=type(card).__name__)
        first = min(cards, key=lambda c: c.tp_rank)
        for name in _SHARED_FIELDS:
            ref = getattr(first, name)
            odd = sorted(c.tp_rank for c in cards if getattr(c, name) != ref)
            if odd:
                values = sorted({repr(getattr(c, name)) for c in cards})
                raise EngineCardError(f"ranks disagree on {name}: {', '.join(values)}", field=name,
                                      value=tuple(getattr(c, name) for c in cards), ranks=odd)
        tp = first.tp_size
        by_rank: dict[int, RankCard] = {}
        for card in cards:
            if not 0 <= card.tp_rank < tp:
                raise EngineCardError(f"rank {card.tp_rank} is outside [0, {tp})", field="tp_rank",
                                      value=card.tp_rank, ranks=(card.tp_rank,))
            if card.tp_rank in by_rank:
                raise EngineCardError(f"rank {card.tp_rank} is listed twice", field="tp_rank", value=card.tp_rank,
                                      ranks=(card.tp_rank,))
            by_rank[card.tp_rank] = card
        missing = [r for r in range(tp) if r not in by_rank]
        if missing:
            raise EngineCardError(f"ranks {missing} of TP {tp} sent no card", field="tp_rank", value=tuple(missing),
                                  ranks=missing)
        addresses = tuple(by_rank[r].address for r in range(tp))
        for r, address in enumerate(addresses):
            if not isinstance(address, str) or not address:
                raise EngineCardError(f"rank {r} has no side-channel address", field="address", value=address,
                                      ranks=(r,))
            twins = [o for o, other in enumerate(addresses) if other == address]
            if len(twins) > 1:
                raise EngineCardError(f"ranks {twins} share the address {address!r}", field="address",
                                      value=address, ranks=twins)
        if not first.lease_s > 0:
            raise EngineCardError(f"lease_s={first.lease_s!r} must be positive", field="lease_s",
                                  value=first.lease_s)
        return cls(engine_id=first.engine_id, incarnation=first.incarnation, tp_size=tp, addresses=addresses,
                   lease_s=float(first.lease_s), block_size=first.block_size, num_blocks=first.num_blocks,
                   group_kinds=tuple(first.group_kinds), fingerprint=first.fingerprint)


def issue_ticket(card: EngineCard, request_id: str, block_ids_per_group: Sequence[Sequence[int]], num_tokens: int,
                 *, nonce: int | None = None, secret: bytes | None = None) -> wire.Ticket:
    """The ticket every rank of ``card``'s engine will hold the request with (pure: nothing is pinned).

    ``block_ids_per_group``: in this library's group order (attention groups first), exactly the
    blocks of ``num_tokens`` tokens. ``nonce``: None draws a fresh one with ``secrets``. ``secret``:
    the engines' shared secret (engine/auth.py ``load_secret``), which keys the ticket's MAC
    (engine/claims.py); the producer ranks refuse a ticket signed without it when they have one.

    Raises:
        ConfigError: an empty request id, a negative or non-integer ``num_tokens``, a nonce
            outside [0, 2**63).
        PlanError (subclasses): block ids of the wrong count, out of range or repeated.
    """
    if not isinstance(request_id, str) or not request_id:
        raise ConfigError(f"request_id={request_id!r} must be a non-empty string", field="request_id",
                          value=request_id)
    if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
        raise ConfigError(f"num_tokens={num_tokens!r} must be a non-negative integer", field="num_tokens",
                          value=num_tokens)
    if nonce is None:
        nonce = secrets.randbits(63)
    elif not isinstance(nonce, int) or isinstance(nonce, bool) or not 0 <= nonce < NONCE_LIMIT:
        raise ConfigError(f"nonce={nonce!r} must be an integer in [0, 2**63)", field="nonce", value=nonce)
    ids = block_id_arrays("producer", block_ids_per_group, len(card.group_kinds))
    validate_block_ids("producer", ids, card.group_kinds, num_tokens, card.block_size, card.num_blocks, exact=True)
    return claims.sign(wire.Ticket(
        engine_id=card.engine_id, incarnation=card.incarnation, addresses=card.addresses, tp_size=card.tp_size,
        request_id=request_id, nonce=int(nonce), block_ids=tuple(tuple(int(b) for b in arr) for arr in ids),
        num_tokens=num_tokens, state_position=num_tokens, lease_s=float(card.lease_s),
    ), secret)


_ENCODER = msgspec.msgpack.Encoder()
_RANK_CARD_DECODER = msgspec.msgpack.Decoder(RankCard)


def encode_rank_card(card: RankCard) -> bytes:
    """A rank card as bytes, for engines whose handshake metadata carries opaque bytes."""
    return _ENCODER.encode(card)


def decode_rank_card(data: bytes) -> RankCard:
    """Raises WireDecodeError for anything that is not exactly a RankCard."""
    try:
        return _RANK_CARD_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as exc:
        raise WireDecodeError(f"not a rank card: {exc}", kind="rank_card") from exc
