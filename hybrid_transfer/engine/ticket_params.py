"""A ticket as a JSON-safe dict, for a serving engine's request parameters (vLLM's ``kv_transfer_params``).

Routers in JavaScript read every JSON number as a double and silently round integers above
2**53: the nonce (up to 2**63) and the incarnation (up to 2**62) travel as decimal strings.
Decoding is strict: every field present, no other field, each of its exact type, range and
size (engine/inputs.py's caps on ranks, groups and block ids), every address ``tcp://host:port``
(engine/addresses.py) and as many addresses as ``tp_size``. The params come from a client's request,
so a failure is always a TicketParamsError naming the field, with the value cut to 200 characters:
never a ValueError or OverflowError of Python's own (docs/limits.md#tickets).
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_transfer.engine.addresses import parse_address, shown
from hybrid_transfer.engine.inputs import (
    MAX_BLOCK_ID,
    MAX_ENGINE_ID_CHARS,
    MAX_TICKET_BLOCK_IDS,
    MAX_TICKET_GROUPS,
    MAX_TICKET_RANKS,
    MAX_TICKET_TOKENS,
)
from hybrid_transfer.engine.wire import MAX_AUTH_BYTES, MAX_REQUEST_ID_CHARS, PROTOCOL_VERSION, Ticket
from hybrid_transfer.errors import ConfigError, TicketParamsError

_NONCE_LIMIT = 1 << 63  # nonces and incarnations: as drawn by issue_ticket and Producer.hold, int64 on the wire
_FIELDS = ("version", "engine_id", "incarnation", "addresses", "tp_size", "request_id", "nonce", "block_ids",
           "num_tokens", "state_position", "lease_s", "mac")


def ticket_to_params(ticket: Ticket) -> dict[str, Any]:
    """The ticket as a dict of JSON types only; no integer above 2**53 (those become strings)."""
    return {
        "version": ticket.version,
        "engine_id": ticket.engine_id,
        "incarnation": str(ticket.incarnation),
        "addresses": list(ticket.addresses),
        "tp_size": ticket.tp_size,
        "request_id": ticket.request_id,
        "nonce": str(ticket.nonce),
        "block_ids": [list(group) for group in ticket.block_ids],
        "num_tokens": ticket.num_tokens,
        "state_position": ticket.state_position,
        "lease_s": float(ticket.lease_s),
        "mac": ticket.mac.hex(),
    }


def ticket_from_params(params: Any) -> Ticket:
    """The ticket back from ``ticket_to_params``'s dict (after any number of JSON round trips).

    Raises:
        TicketParamsError: not a dict, a missing or unknown field, a field of the wrong type, range
            or size, a malformed address, or another protocol version; ``field`` names the first
            bad field, the message shows its value cut to 200 characters.
    """
    if not isinstance(params, dict):
        raise TicketParamsError(f"expected a JSON object, got {type(params).__name__}", field="*",
                                value=type(params).__name__)
    for key in params:
        if key not in _FIELDS:
            name = key if isinstance(key, str) and len(key) <= 80 else shown(key, 80)
            raise TicketParamsError("is not a ticket field", field=name, value=shown(params[key]))
    for key in _FIELDS:
        if key not in params:
            raise TicketParamsError("is missing", field=key)
    version = _int(params, "version", 0, PROTOCOL_VERSION + 1)
    if version != PROTOCOL_VERSION:
        raise TicketParamsError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}", field="version",
                                value=version)
    tp_size = _int(params, "tp_size", 1, MAX_TICKET_RANKS)
    return Ticket(
        engine_id=_str(params, "engine_id", MAX_ENGINE_ID_CHARS),
        incarnation=_string_int(params, "incarnation", _NONCE_LIMIT),
        addresses=_addresses(params, tp_size),
        tp_size=tp_size,
        request_id=_str(params, "request_id", MAX_REQUEST_ID_CHARS),
        nonce=_string_int(params, "nonce", _NONCE_LIMIT),
        block_ids=_block_ids(params),
        num_tokens=_int(params, "num_tokens", 0, MAX_TICKET_TOKENS),
        state_position=_int(params, "state_position", 0, MAX_TICKET_TOKENS),
        lease_s=_seconds(params, "lease_s"),
        version=version,
        mac=_hex(params, "mac"),
    )


def _bad(field: str, value: Any, why: str) -> TicketParamsError:
    return TicketParamsError(f"{shown(value)} {why}", field=field, value=value)


def _addresses(params: dict, tp_size: int) -> tuple[str, ...]:
    """One well-formed, distinct ``tcp://host:port`` per producer rank."""
    addresses = params["addresses"]
    if not isinstance(addresses, list) or not all(isinstance(a, str) and a for a in addresses):
        raise _bad("addresses", addresses, "must be a list of non-empty strings")
    if len(addresses) != tp_size:
        raise _bad("addresses", addresses, f"lists {len(addresses)} addresses for tp_size {tp_size}")
    for address in addresses:
        try:
            parse_address(address)
        except ConfigError as exc:
            raise _bad("addresses", address, f"is not a side-channel address: {exc}") from None
    if len(set(addresses)) != len(addresses):
        raise _bad("addresses", addresses, "names one address twice")
    return tuple(addresses)


def _block_ids(params: dict) -> tuple[tuple[int, ...], ...]:
    block_ids = params["block_ids"]
    if not isinstance(block_ids, list) or not all(isinstance(g, list) for g in block_ids):
        raise _bad("block_ids", block_ids, "must be a list of lists of non-negative integers")
    if len(block_ids) > MAX_TICKET_GROUPS:
        raise _bad("block_ids", block_ids, f"lists {len(block_ids)} groups, at most {MAX_TICKET_GROUPS}")
    total = sum(len(g) for g in block_ids)
    if total > MAX_TICKET_BLOCK_IDS:
        raise _bad("block_ids", block_ids, f"lists {total} block ids, at most {MAX_TICKET_BLOCK_IDS}")
    for group in block_ids:
        if group and all(type(b) is int for b in group) and 0 <= min(group) and max(group) <= MAX_BLOCK_ID:
            continue  # the common case, at C speed
        for b in group:
            if not _is_int(b) or not 0 <= b <= MAX_BLOCK_ID:
                raise _bad("block_ids", b, f"is not a block id: every id must be an integer in [0, {MAX_BLOCK_ID}]")
    return tuple(tuple(g) for g in block_ids)


def _seconds(params: dict, field: str) -> float:
    value = params[field]
    if not isinstance(value, (int, float)) or isinstance(value, bool) or (
            isinstance(value, int) and value.bit_length() > 64) or not math.isfinite(value) or value <= 0:
        raise _bad(field, value, "must be a positive, finite number of seconds")
    return float(value)


def _hex(params: dict, field: str) -> bytes:
    """Bytes written as lower-case hex (at most MAX_AUTH_BYTES bytes; "" for none)."""
    value = params[field]
    if not isinstance(value, str) or len(value) > 2 * MAX_AUTH_BYTES or len(value) % 2 or any(
            c not in "0123456789abcdef" for c in value):
        raise _bad(field, value, f"must be a string of at most {2 * MAX_AUTH_BYTES} lower-case hex digits")
    return bytes.fromhex(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(params: dict, field: str, minimum: int, maximum: int) -> int:
    value = params[field]
    if not _is_int(value) or not minimum <= value <= maximum:
        raise _bad(field, value, f"must be an integer in [{minimum}, {maximum}]")
    return value


def _str(params: dict, field: str, max_chars: int) -> str:
    value = params[field]
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise _bad(field, value, f"must be a non-empty string of at most {max_chars} characters")
    return value


def _string_int(params: dict, field: str, limit: int) -> int:
    """A non-negative integer written in decimal digits (a string: JSON numbers lose bits above 2**53)."""
    value = params[field]
    if not isinstance(value, str) or not 0 < len(value) <= 20 or not value.isascii() or not value.isdigit() \
            or int(value) >= limit:
        raise _bad(field, value, f"must be a string of decimal digits below 2**{limit.bit_length() - 1}")
    return int(value)
