"""The ``kv_transfer_params`` dict: what prefill returns, the proxy forwards and decode reads.

Every value is JSON-safe (strings, booleans, small integers, lists): routers written in
JavaScript round integers above 2**53, so the ticket's nonce and incarnation travel as strings.
docs/vllm.md documents each field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybrid_transfer.engine.ticket_params import ticket_from_params, ticket_to_params
from hybrid_transfer.engine.wire import Ticket
from hybrid_transfer.errors import TicketError

DO_REMOTE_DECODE = "do_remote_decode"  # to prefill: hand this request off (cut to N-1, one token)
DO_REMOTE_PREFILL = "do_remote_prefill"  # to decode: the prompt's cache is read from the ticket's engine
TICKET = "hybrid_transfer_ticket"  # the ticket, as ticket_to_params writes it
TRUNCATED = "hybrid_transfer_truncated"  # prefill-internal: the prompt was already cut (preemptions)


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


def ticket_of(params: Mapping[str, Any] | None, request_id: str) -> Ticket:
    """The ticket a decode request carries.

    Raises:
        TicketError: no ticket, or one that does not decode (the message says what is wrong).
    """
    if not params or TICKET not in params:
        raise TicketError(f"kv_transfer_params carry no {TICKET!r}", request_id=request_id)
    try:
        return ticket_from_params(params[TICKET])
    except TicketError:
        raise
    except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad ticket
        raise TicketError(f"kv_transfer_params[{TICKET!r}] is not a ticket: {exc}", request_id=request_id) from exc
