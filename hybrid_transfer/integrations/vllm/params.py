"""The ``kv_transfer_params`` dict: what prefill returns, the proxy forwards and decode reads.

Every value is JSON-safe (strings, booleans, small integers, lists): routers written in
JavaScript round integers above 2**53, so the ticket's nonce and incarnation travel as strings.
docs/vllm.md documents each field.

The dict arrives in the request body of vLLM's OpenAI server, so any client decides what it
holds: ``check_request_params`` judges it whole before the connector acts on any of it
(docs/vllm.md#untrusted-params).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hybrid_transfer.engine import inputs
from hybrid_transfer.engine.ticket_params import ticket_from_params, ticket_to_params
from hybrid_transfer.engine.wire import Ticket
from hybrid_transfer.errors import TicketError, TicketParamsError

DO_REMOTE_DECODE = "do_remote_decode"  # to prefill: hand this request off (cut to N-1, one token)
DO_REMOTE_PREFILL = "do_remote_prefill"  # to decode: the prompt's cache is read from the ticket's engine
TICKET = "hybrid_transfer_ticket"  # the ticket, as ticket_to_params writes it
TRUNCATED = "hybrid_transfer_truncated"  # prefill-internal: the prompt was already cut (preemptions)

INTERNAL_KEYS = frozenset({TRUNCATED})  # written by the connector only: a client sending one is refused
MAX_PARAMS_KEYS = 64  # vLLM's own fields, ours and a proxy's; more is not a proxy's doing
MAX_ID_CHARS = 256  # remote_engine_id / remote_request_id
_MAX_TOKENS = 1 << 31
# Informational fields prefill returns (and vLLM's NIXL proxy sends as null): type when not null.
_INFO_TYPES = {"remote_engine_id": str, "remote_request_id": str, "remote_num_tokens": int,
               "remote_prefill_cached_tokens": int}


class Role(enum.Enum):
    """What a request's params ask of the connector."""

    NONE = "none"  # no hand-off: a plain request
    HAND_OFF = "hand_off"  # prefill: compute N-1 tokens, keep the blocks, return a ticket
    LOAD = "load"  # decode: load the prompt's cache from the ticket's engine


@dataclass(frozen=True)
class RequestParams:
    """A request's params, judged: its role and, to load, its decoded ticket."""

    role: Role
    ticket: Ticket | None = None


def prefill_result(ticket: Ticket) -> dict[str, Any]:
    """What a prefill engine returns for a handed-off request; the proxy forwards it verbatim to decode."""
    return {
        DO_REMOTE_PREFILL: True,
        DO_REMOTE_DECODE: False,
        "remote_engine_id": ticket.engine_id,
        "remote_request_id": ticket.request_id,
        "remote_num_tokens": ticket.num_tokens,
        TICKET: ticket_to_params(ticket),
    }


def asks_to_load(params: Any) -> bool:
    """Whether params that may be malformed ask decode to load (so a refusal follows the load failure policy)."""
    return isinstance(params, Mapping) and bool(params.get(DO_REMOTE_PREFILL))


def check_request_params(params: Any, *, internal_ok: bool = False) -> RequestParams:
    """Judge a request's ``kv_transfer_params`` whole, before anything acts on them.

    Types, counts and sizes of every field the connector or vLLM reads, the ticket through the
    strict codec (engine/ticket_params.py), the informational ``remote_*`` fields against the
    ticket, and no connector-internal key unless ``internal_ok`` (the connector's own second look).

    Raises:
        TicketParamsError: ``field`` names the first bad field.
    """
    if params is None:
        return RequestParams(Role.NONE)
    if not isinstance(params, dict):
        raise TicketParamsError("kv_transfer_params must be a JSON object", field="*", value=type(params).__name__)
    if len(params) > MAX_PARAMS_KEYS:
        raise TicketParamsError(f"{len(params)} keys, at most {MAX_PARAMS_KEYS}", field="*", value=len(params))
    for key in params:
        if not isinstance(key, str):
            raise TicketParamsError("keys must be strings", field="*", value=type(key).__name__)
        if key in INTERNAL_KEYS and not internal_ok:
            raise TicketParamsError("is the connector's own; a client may not set it", field=key, value=params[key])
    hand_off, load = _flag(params, DO_REMOTE_DECODE), _flag(params, DO_REMOTE_PREFILL)
    if hand_off and load:
        raise TicketParamsError(f"both {DO_REMOTE_DECODE!r} and {DO_REMOTE_PREFILL!r} are true",
                                field=DO_REMOTE_PREFILL, value=True)
    for key, kind in _INFO_TYPES.items():
        value = params.get(key)
        if value is None:
            continue
        if kind is str and not (isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS):
            raise TicketParamsError(f"must be a string of 1 to {MAX_ID_CHARS} characters", field=key, value=value)
        if kind is int and not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _MAX_TOKENS):
            raise TicketParamsError("must be an integer in [0, 2**31)", field=key, value=value)
    if hand_off:
        return RequestParams(Role.HAND_OFF)
    if not load:  # a ticket without the flag is never read
        return RequestParams(Role.NONE)
    if TICKET not in params:
        raise TicketParamsError("is missing", field=TICKET)
    try:
        ticket = ticket_from_params(params[TICKET])
    except TicketParamsError:
        raise
    except Exception as exc:  # noqa: BLE001 - the codec must raise only its own error; never let one escape
        raise TicketParamsError(f"does not decode ({type(exc).__name__})", field=TICKET) from exc
    if len(ticket.addresses) != ticket.tp_size:
        raise TicketParamsError(f"{len(ticket.addresses)} addresses for its tp_size", field="addresses")
    for key, want in (("remote_engine_id", ticket.engine_id), ("remote_request_id", ticket.request_id),
                      ("remote_num_tokens", ticket.num_tokens)):
        if params.get(key) is not None and params[key] != want:
            raise TicketParamsError("disagrees with the ticket", field=key, value=params[key])
    return RequestParams(Role.LOAD, ticket)


def recheck_ticket(ticket: Any) -> Ticket:
    """A worker's own look at a ticket it was handed: the engine's ticket check (engine/inputs.py, the one
    ``Consumer.start_read`` runs), with no JSON round trip on the worker thread.

    Raises:
        TicketParamsError: a field that check refuses (named), or an object that is not a Ticket.
    """
    if not isinstance(ticket, Ticket):
        raise TicketParamsError("not a ticket", field="*", value=type(ticket).__name__)
    try:
        return inputs.ticket(ticket)
    except TicketError as exc:
        raise TicketParamsError(str(exc), field=getattr(exc, "field", None) or "*") from exc
    except Exception as exc:  # noqa: BLE001 - as in check_request_params
        raise TicketParamsError(f"does not decode ({type(exc).__name__})", field="*") from exc


def _flag(params: dict, key: str) -> bool:
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        raise TicketParamsError("must be true, false or null", field=key, value=value)
    return bool(value)
