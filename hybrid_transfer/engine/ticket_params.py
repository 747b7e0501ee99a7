"""A ticket as a JSON-safe dict, for a serving engine's request parameters (vLLM's ``kv_transfer_params``).

Routers in JavaScript read every JSON number as a double and silently round integers above
2**53: the nonce (up to 2**63) and the incarnation (up to 2**62) travel as decimal strings.
Decoding is strict: every field present, no other field, each of its exact type; a failure
names the field.
"""

from __future__ import annotations

import math
from typing import Any

from hybrid_transfer.engine.wire import PROTOCOL_VERSION, Ticket
from hybrid_transfer.errors import TicketParamsError

_NONCE_LIMIT = 1 << 63  # as drawn by issue_ticket and Producer.hold
_INCARNATION_LIMIT = 1 << 64
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
        TicketParamsError: not a dict, a missing or unknown field, a field of the wrong type or
            range, or another protocol version; ``field`` names the first bad field.
    """
    if not isinstance(params, dict):
        raise TicketParamsError(f"expected a JSON object, got {type(params).__name__}", field="*",
                                value=type(params).__name__)
    for key in params:
        if key not in _FIELDS:
            raise TicketParamsError("is not a ticket field", field=str(key), value=params[key])
    for key in _FIELDS:
        if key not in params:
            raise TicketParamsError("is missing", field=key)
    version = _int(params, "version")
    if version != PROTOCOL_VERSION:
        raise TicketParamsError(f"protocol version {version}, this side speaks {PROTOCOL_VERSION}", field="version",
                                value=version)
    addresses = params["addresses"]
    if not isinstance(addresses, list) or not all(isinstance(a, str) and a for a in addresses):
        raise TicketParamsError("must be a list of non-empty strings", field="addresses", value=addresses)
    block_ids = params["block_ids"]
    if not isinstance(block_ids, list) or not all(
            isinstance(g, list) and all(_is_int(b) and b >= 0 for b in g) for g in block_ids):
        raise TicketParamsError("must be a list of lists of non-negative integers", field="block_ids",
                                value=block_ids)
    lease_s = params["lease_s"]
    if not isinstance(lease_s, (int, float)) or isinstance(lease_s, bool) or not math.isfinite(lease_s) \
            or lease_s <= 0:
        raise TicketParamsError("must be a positive, finite number of seconds", field="lease_s", value=lease_s)
    return Ticket(
        engine_id=_str(params, "engine_id"),
        incarnation=_string_int(params, "incarnation", _INCARNATION_LIMIT),
        addresses=tuple(addresses),
        tp_size=_int(params, "tp_size", minimum=1),
        request_id=_str(params, "request_id"),
        nonce=_string_int(params, "nonce", _NONCE_LIMIT),
        block_ids=tuple(tuple(g) for g in block_ids),
        num_tokens=_int(params, "num_tokens"),
        state_position=_int(params, "state_position"),
        lease_s=float(lease_s),
        version=version,
        mac=_hex(params, "mac"),
    )


def _hex(params: dict, field: str) -> bytes:
    """Bytes written as lower-case hex (at most 64 bytes; "" for none)."""
    value = params[field]
    if not isinstance(value, str) or len(value) > 128 or len(value) % 2 or any(c not in "0123456789abcdef"
                                                                               for c in value):
        raise TicketParamsError("must be a string of at most 128 lower-case hex digits", field=field, value=value)
    return bytes.fromhex(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(params: dict, field: str, minimum: int = 0) -> int:
    value = params[field]
    if not _is_int(value) or value < minimum:
        raise TicketParamsError(f"must be an integer >= {minimum}", field=field, value=value)
    return value


def _str(params: dict, field: str) -> str:
    value = params[field]
    if not isinstance(value, str) or not value:
        raise TicketParamsError("must be a non-empty string", field=field, value=value)
    return value


def _string_int(params: dict, field: str, limit: int) -> int:
    """A non-negative integer written in decimal digits (a string: JSON numbers lose bits above 2**53)."""
    value = params[field]
    if not isinstance(value, str) or not value.isascii() or not value.isdigit() or len(value) > 20 \
            or int(value) >= limit:
        raise TicketParamsError(f"must be a string of decimal digits below 2**{limit.bit_length() - 1}",
                                field=field, value=value)
    return int(value)
