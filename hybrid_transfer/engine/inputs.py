"""Type and range checks of what embedders pass to hold() and start_read(), before anything is pinned.

Python lets a bool pass for an int and numpy turns ``[1, True]`` into ``[1, 1]``; a value that
passes here but could not travel in a ticket (a nonce of 2**64, an int request id) would pin blocks
under a ticket no consumer can decode. Every refusal names the argument and its value.
"""

from __future__ import annotations

import numbers
import typing
from collections.abc import Sequence
from operator import itemgetter
from typing import Annotated

import msgspec
import numpy as np

from hybrid_transfer.engine import claims, wire
from hybrid_transfer.engine.addresses import parse_address, shown
from hybrid_transfer.engine.wire import MAX_NAME_CHARS, MAX_NONCE, MAX_REQUEST_ID_CHARS
from hybrid_transfer.errors import ConfigError, PlanError, TicketError, WireDecodeError
from hybrid_transfer.plan.validate import plain_int64s


def is_integer(value: object) -> bool:
    """An int or numpy integer, never a bool (Python's or numpy's)."""
    if type(value) is int:  # the usual case, without the ABC check's cost
        return True
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(field: str, value: object) -> int:
    """A non-negative integer argument (token counts, state positions), as a Python int."""
    if type(value) is int and value >= 0:  # the usual case, twice per request
        return value
    if not is_integer(value) or int(value) < 0:  # type: ignore[call-overload]
        raise ConfigError(f"{field}={value!r} must be a non-negative integer (not a bool)", field=field,
                          value=value)
    return int(value)  # type: ignore[call-overload]


def nonce(field: str, value: object) -> int:
    """A nonce or incarnation: an integer in [0, 2**63), the range a ticket carries."""
    if not is_integer(value) or not 0 <= int(value) <= MAX_NONCE:  # type: ignore[call-overload]
        raise ConfigError(f"{field}={value!r} must be an integer in [0, 2**63)", field=field, value=value)
    return int(value)  # type: ignore[call-overload]


def request_id(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        shown = f"{value[:40]!r}... ({len(value)} characters)" if isinstance(value, str) and value else repr(value)
        raise ConfigError(f"request_id={shown} must be a non-empty str of at most {MAX_REQUEST_ID_CHARS} "
                          "characters", field="request_id", value=value)
    return value


# Agent names are the engine id plus "-p<rank>-<incarnation in hex>" (or "-c<rank>-<8 hex>"), and must
# stay within the wire's name cap.
MAX_ENGINE_ID_CHARS = MAX_NAME_CHARS - 48


def engine_id(value: object) -> str:
    """An engine id: it travels in tickets, and prefixes the agent names sent in handshakes."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ENGINE_ID_CHARS:
        shown = f"{value[:40]!r}... ({len(value)} characters)" if isinstance(value, str) and value else repr(value)
        raise ConfigError(f"engine_id={shown} must be a non-empty str of at most {MAX_ENGINE_ID_CHARS} characters",
                          field="engine_id", value=value)
    return value


def block_id_lists(side: str, block_ids_per_group: object) -> tuple[tuple[int, ...], ...] | None:
    """Every group a flat sequence (or array) of integers; the planner's checks of counts and ranges follow.

    Returns the groups as tuples of plain ints when the one-call check proved them (the usual lists: the
    consumer keeps that copy instead of converting again), else None once the per-group checks pass."""
    proven = _plain_id_lists(block_ids_per_group)
    if proven:
        return proven
    if type(block_ids_per_group) not in (list, tuple) and (isinstance(block_ids_per_group, (str, bytes)) or
                                                          not isinstance(block_ids_per_group, (Sequence, np.ndarray))):
        raise PlanError(f"{side} block ids must be one sequence of integers per cache group, got "
                        f"{block_ids_per_group!r}", side=side, block_ids=block_ids_per_group)
    for group, ids in enumerate(block_ids_per_group):
        if type(ids) in (list, tuple) and plain_int64s(ids):
            continue  # the common case, checked in C: every id an exact int within int64
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise PlanError(f"{side} group {group}: block ids must be a flat list of integers, got an array "
                                f"of {ids.dtype} with shape {ids.shape}", side=side, group=group, block_ids=ids)
            continue
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise PlanError(f"{side} group {group}: block ids must be a flat list of integers, got {ids!r}",
                            side=side, group=group, block_ids=ids)
        for b in ids:
            if type(b) is not int and not is_integer(b):  # the exact-type test keeps long lists cheap
                raise PlanError(f"{side} group {group}: block ids must be integers (not bools), got {shown(b)} in "
                                f"{shown(list(ids)[:16])}", side=side, group=group, block_ids=ids)
            if int(b).bit_length() > 63:  # numpy cannot hold it, and Python cannot print it past 4,300 digits
                raise PlanError(f"{side} group {group}: block id {shown(int(b))} is out of range", side=side,
                                group=group, block_ids=ids)


_LISTS = frozenset({list, tuple})
_Int64 = Annotated[int, msgspec.Meta(ge=-(1 << 63) + 1, le=(1 << 63) - 1)]  # plan.validate.plain_int64s' range


class _IdLists(msgspec.Struct, array_like=True):
    """What _plain_id_lists converts to: msgspec keeps a Struct's checks built, a bare tuple type's it builds
    again on every call (a microsecond)."""

    groups: tuple[tuple[_Int64, ...], ...]


def _plain_id_lists(groups: object) -> tuple[tuple[int, ...], ...] | None:
    """Lists (or tuples) of ints within int64, never a bool, proven by one msgspec call over every group: the
    groups as that call's tuples of ints, else None.

    The usual local ids; anything else (numpy, a bool, an int past int64, a set) is False and the per-group
    loop finds and names it. msgspec also takes an int subclass (an IntEnum), as that loop does."""
    if type(groups) not in _LISTS or not _LISTS.issuperset(map(type, groups)):
        return None  # msgspec would take a set for a tuple: the loop refuses one
    if sum(map(len, groups)) > MAX_TICKET_BLOCK_IDS:
        return None  # msgspec copies what it proves: past this the loop's checks (which copy nothing) run
    try:
        return msgspec.convert((groups,), _IdLists).groups
    except msgspec.ValidationError:
        return None


# ---- tickets (issue 19): what a client's request may make a consumer do is bounded here -----------------
# A ticket reaches a decode worker inside a client's request (vLLM's kv_transfer_params). These caps
# bound what one ticket can make a consumer allocate, iterate or connect to before anything else looks
# at it; every honest ticket is far below them (TP 8, a handful of cache groups, 2**17 tokens).
MAX_TICKET_RANKS = 64  # producer TP ranks (so side-channel addresses) one ticket may name
MAX_TICKET_GROUPS = 64  # cache groups of block ids
MAX_TICKET_BLOCK_IDS = 1 << 20  # block ids over all groups
MAX_BLOCK_ID = (1 << 31) - 1  # vLLM's block ids are int32
MAX_TICKET_TOKENS = 1 << 31
_INT_FIELDS = ("version", "incarnation", "tp_size", "nonce", "num_tokens", "state_position")


def ticket(value: object) -> wire.Ticket:
    """A ticket handed to ``Consumer.start_read`` or ``decline``: every field's type, range and size, the
    address syntax and the address count, checked before any socket, connect or pin.

    Raises:
        TicketError: naming the field and its value (cut to 200 characters).
    """
    if not isinstance(value, wire.Ticket):
        raise TicketError(f"expected a Ticket, got {type(value).__name__} (decode bytes with decode_ticket)",
                          request_id="?")
    checked = _honest_ticket(value)
    return checked if checked is not None else _stepwise_ticket(value)


def _stepwise_ticket(value: wire.Ticket) -> wire.Ticket:
    """The checks one by one, in an order that names the bad field and never prints a huge value (ticket's
    slow path: something is wrong, or the ticket is of a form _honest_ticket leaves to it)."""
    rid = value.request_id if isinstance(value.request_id, str) else shown(value.request_id)
    rid = rid if len(rid) <= MAX_REQUEST_ID_CHARS else shown(rid)

    def bad(field: str, shown_value: str, why: str) -> TicketError:
        return TicketError(f"{field}={shown_value} {why}", request_id=rid, field=field)

    for field in _INT_FIELDS:  # wire.check_ticket's own message would try to print a 100,000-digit int
        number = getattr(value, field)
        if is_integer(number) and int(number).bit_length() > 64:
            raise bad(field, shown(int(number)), "is out of range")
    if is_integer(value.tp_size) and not 0 < value.tp_size <= MAX_TICKET_RANKS:
        raise bad("tp_size", shown(value.tp_size), f"must be in [1, {MAX_TICKET_RANKS}]")
    addresses = value.addresses
    if isinstance(addresses, (list, tuple)) and len(addresses) > MAX_TICKET_RANKS:
        raise bad("addresses", shown(addresses), f"lists {len(addresses)} addresses, at most {MAX_TICKET_RANKS}")
    _check_block_ids(value.block_ids, bad)
    try:
        checked = wire.check_ticket(value)
    except WireDecodeError as exc:
        text = str(exc)
        raise TicketError(text if len(text) <= 600 else f"{text[:600]}...", request_id=rid) from exc
    for field in ("num_tokens", "state_position"):
        if getattr(checked, field) > MAX_TICKET_TOKENS:
            raise bad(field, str(getattr(checked, field)), f"is above {MAX_TICKET_TOKENS}")
    for i, address in enumerate(checked.addresses):
        try:
            parse_address(address)
        except ConfigError as exc:
            raise bad(f"addresses[{i}]", shown(address), f"is not a side-channel address: {exc}") from None
    if len(set(checked.addresses)) != len(checked.addresses):
        raise bad("addresses", shown(checked.addresses), "names one address twice")
    return checked


# The honest ticket's check (_honest_ticket) is a msgpack round trip in two parts: the fields the claim digest
# covers, in its order (so those bytes are also the digest's, claims.digest_of_encoded), and the rest. Each
# part decodes with wire.Ticket's own type for every field, tightened to this module's caps where it has one.
_FIELDS = wire.Ticket.__struct_fields__
_REST_FIELDS = tuple(f for f in _FIELDS if f not in claims.DIGEST_FIELDS)  # a field added to Ticket lands here
_Tokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TICKET_TOKENS)]
_TIGHTER = {  # each at least as strict as the field's type in wire.Ticket (tests/engine/test_admission.py)
    "addresses": Annotated[tuple[wire.Address, ...], msgspec.Meta(max_length=MAX_TICKET_RANKS)],
    "tp_size": Annotated[int, msgspec.Meta(ge=1, le=MAX_TICKET_RANKS)],
    "block_ids": Annotated[tuple[tuple[Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)], ...], ...],
                           msgspec.Meta(max_length=MAX_TICKET_GROUPS)],
    "num_tokens": _Tokens,
    "state_position": _Tokens,
}


def _part_decoder(fields: tuple[str, ...]) -> msgspec.msgpack.Decoder:
    """A decoder of the tuple of these fields' values, each of its (tightened) Ticket type."""
    hints = typing.get_type_hints(wire.Ticket, include_extras=True)
    return msgspec.msgpack.Decoder(tuple[tuple(_TIGHTER.get(f, hints[f]) for f in fields)])  # type: ignore[misc]


_DIGEST_DECODER = _part_decoder(claims.DIGEST_FIELDS)
_REST_DECODER = _part_decoder(_REST_FIELDS)
_DIGEST_PART = itemgetter(*(_FIELDS.index(f) for f in claims.DIGEST_FIELDS))
_REST_PART = itemgetter(*(_FIELDS.index(f) for f in _REST_FIELDS))
_IN_TICKET_ORDER = itemgetter(*((*claims.DIGEST_FIELDS, *_REST_FIELDS).index(f) for f in _FIELDS))
_VERSION, _ADDRESSES = _REST_FIELDS.index("version"), _REST_FIELDS.index("addresses")
_ENCODER = msgspec.msgpack.Encoder()


def _honest_ticket(value: wire.Ticket) -> wire.Ticket | None:
    """The checked ticket when every check passes, else None (``ticket`` then finds and names the fault).

    The same rules as ``ticket``'s step-by-step path: the size caps first (a ticket of millions of ids is never
    encoded), then msgspec's round trip, whose types carry every range, then the addresses' syntax. A handful
    of C calls for the honest ticket every request brings; the digest's bytes come with it (claims)."""
    if type(value) is not wire.Ticket:  # a subclass may carry more: the step-by-step path judges it
        return None
    block_ids, addresses = value.block_ids, value.addresses
    if type(block_ids) not in _LISTS or type(addresses) not in _LISTS:
        return None
    if len(block_ids) > MAX_TICKET_GROUPS or len(addresses) > MAX_TICKET_RANKS:
        return None
    fields = msgspec.structs.astuple(value)
    try:
        if sum(map(len, block_ids)) > MAX_TICKET_BLOCK_IDS:
            return None
        encoded = _ENCODER.encode(_DIGEST_PART(fields))
        read = _DIGEST_DECODER.decode(encoded)
        rest = _REST_DECODER.decode(_ENCODER.encode(_REST_PART(fields)))
    except Exception:  # noqa: BLE001 - msgspec's refusals, or a hostile group's __len__: the named checks judge it
        return None
    addresses = rest[_ADDRESSES]
    if rest[_VERSION] != wire.PROTOCOL_VERSION or len(set(addresses)) != len(addresses):
        return None
    try:
        for address in addresses:
            parse_address(address)
    except ConfigError:
        return None
    checked = wire.Ticket(*_IN_TICKET_ORDER(read + rest))
    claims.remember_encoded(checked, encoded)
    return checked


def _check_block_ids(block_ids: object, bad) -> None:
    """Caps on the count of groups and of ids, and ids within int32; types are wire.check_ticket's."""
    if not isinstance(block_ids, (list, tuple)):
        return
    if len(block_ids) > MAX_TICKET_GROUPS:
        raise bad("block_ids", shown(block_ids), f"lists {len(block_ids)} groups, at most {MAX_TICKET_GROUPS}")
    total = sum(len(g) for g in block_ids if isinstance(g, (list, tuple)))
    if total > MAX_TICKET_BLOCK_IDS:
        raise bad("block_ids", shown(block_ids), f"lists {total} block ids, at most {MAX_TICKET_BLOCK_IDS}")
    groups = [g for g in block_ids if isinstance(g, (list, tuple)) and g]
    try:  # the common case in C: every id comparable and in range (wire.check_ticket then checks the types)
        if min(map(min, groups), default=0) >= 0 and max(map(max, groups), default=0) <= MAX_BLOCK_ID:
            return
    except TypeError:
        pass  # ids of mixed types: find the one out of range, if any, below
    for g, group in enumerate(block_ids):
        if not isinstance(group, (list, tuple)):
            continue
        for i, b in enumerate(group):
            if is_integer(b) and not 0 <= b <= MAX_BLOCK_ID:
                raise bad(f"block_ids[{g}][{i}]", shown(int(b)), f"is outside [0, {MAX_BLOCK_ID}]")
