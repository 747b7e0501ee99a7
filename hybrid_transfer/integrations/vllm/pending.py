"""TEMPORARY stand-ins for engine APIs another branch (issue-12-api) is adding; removed at its merge.

Each one is the smallest thing that lets the connector run; the real ones live in the engine.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from hybrid_transfer.engine import wire
from hybrid_transfer.engine.config import EngineConfig


def issue_ticket(engine_id: str, incarnation: int, addresses: Sequence[str], request_id: str,
                 block_ids: Sequence[Sequence[int]], num_tokens: int, lease_s: float) -> wire.Ticket:
    return wire.Ticket(engine_id=engine_id, incarnation=incarnation, addresses=tuple(addresses),
                       tp_size=len(addresses), request_id=request_id, nonce=secrets.randbits(52),
                       block_ids=tuple(tuple(int(b) for b in g) for g in block_ids), num_tokens=num_tokens,
                       state_position=num_tokens, lease_s=float(lease_s))


def ticket_to_params(ticket: wire.Ticket) -> dict[str, Any]:
    d = msgspec.to_builtins(ticket)
    d["nonce"] = str(ticket.nonce)
    d["incarnation"] = str(ticket.incarnation)
    d.pop("type", None)
    return d


def ticket_from_params(d: Mapping[str, Any]) -> wire.Ticket:
    d = dict(d)
    d["nonce"] = int(d["nonce"])
    d["incarnation"] = int(d["incarnation"])
    return msgspec.convert(d, wire.Ticket)


def engine_config_from_dict(extra: Mapping[str, Any], tp_rank: int) -> EngineConfig:
    d = dict(extra)
    if d.get("side_channel_port"):
        d["side_channel_port"] = int(d["side_channel_port"]) + tp_rank
    return msgspec.convert(d, EngineConfig).validate()
