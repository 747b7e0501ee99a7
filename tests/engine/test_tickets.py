"""Tickets issued by an engine's scheduler from its ranks' cards, and their JSON-safe form (no NIXL here)."""

from __future__ import annotations

import json

import msgspec
import pytest

from hybrid_transfer.engine import claims, wire
from hybrid_transfer.engine.ticket_params import ticket_from_params, ticket_to_params
from hybrid_transfer.engine.tickets import (
    EngineCard,
    RankCard,
    decode_rank_card,
    encode_rank_card,
    issue_ticket,
)
from hybrid_transfer.errors import (
    BlockCountError,
    ConfigError,
    DuplicateBlockError,
    EngineCardError,
    GroupCountError,
    TicketParamsError,
    WireDecodeError,
)
from hybrid_transfer.layout.model import LayerKind

KINDS = (LayerKind.ATTENTION, LayerKind.GDN, LayerKind.GDN, LayerKind.GDN)
BIG = (1 << 63) - 1  # the largest nonce: far above what a JSON double keeps exactly


def _rank(r: int, tp: int = 2, **changes) -> RankCard:
    fields = dict(engine_id="prefill-a", incarnation=(1 << 62) + 7, tp_rank=r, tp_size=tp,
                  address=f"tcp://10.0.0.1:{5600 + r}", lease_s=120.0, block_size=16, num_blocks=64,
                  group_kinds=KINDS, fingerprint="0123456789abcdef", agent_name=f"p{r}")
    return RankCard(**(fields | changes))


def _card(tp: int = 2) -> EngineCard:
    return EngineCard.from_ranks({r: _rank(r, tp) for r in range(tp)})


def test_engine_card_gathers_every_rank_in_rank_order():
    card = EngineCard.from_ranks([_rank(1), _rank(0)])
    assert card.addresses == ("tcp://10.0.0.1:5600", "tcp://10.0.0.1:5601")
    assert (card.engine_id, card.incarnation, card.tp_size) == ("prefill-a", (1 << 62) + 7, 2)
    assert card.engine_key == ("prefill-a", (1 << 62) + 7)
    assert card == EngineCard.from_ranks({0: _rank(0), 1: _rank(1)})


@pytest.mark.parametrize("ranks, field, bad_ranks", [
    ([], "ranks", ()),
    ([_rank(0)], "tp_rank", (1,)),  # rank 1 of TP 2 missing
    ([_rank(0), _rank(0)], "tp_rank", (0,)),
    ([_rank(0), _rank(2)], "tp_rank", (2,)),
    ([_rank(0), _rank(1, incarnation=5)], "incarnation", (1,)),
    ([_rank(0), _rank(1, engine_id="other")], "engine_id", (1,)),
    ([_rank(0), _rank(1, tp=4)], "tp_size", (1,)),
    ([_rank(0), _rank(1, num_blocks=63)], "num_blocks", (1,)),
    ([_rank(0), _rank(1, fingerprint="ffffffffffffffff")], "fingerprint", (1,)),
    ([_rank(0), _rank(1, lease_s=60.0)], "lease_s", (1,)),
    ([_rank(0), _rank(1, address="tcp://10.0.0.1:5600")], "address", (0, 1)),
    ([_rank(0, tp=1, lease_s=0.0)], "lease_s", ()),
])
def test_engine_card_refuses_incomplete_or_inconsistent_ranks(ranks, field, bad_ranks):
    with pytest.raises(EngineCardError) as info:
        EngineCard.from_ranks(ranks)
    assert info.value.field == field
    assert info.value.ranks == bad_ranks
    assert isinstance(info.value, ConfigError)


def test_engine_card_refuses_a_card_keyed_as_another_rank():
    with pytest.raises(EngineCardError) as info:
        EngineCard.from_ranks({0: _rank(0), 2: _rank(1)})
    assert info.value.field == "tp_rank" and info.value.value == 2


def test_rank_card_bytes_round_trip_and_refuse_garbage():
    card = _rank(1)
    assert decode_rank_card(encode_rank_card(card)) == card
    with pytest.raises(WireDecodeError):
        decode_rank_card(b"\x92\x01\x02")
    extra = msgspec.msgpack.encode(msgspec.structs.asdict(card) | {"secret": 1})
    with pytest.raises(WireDecodeError):
        decode_rank_card(extra)


def test_issue_ticket_is_the_ticket_every_rank_holds():
    card = _card()
    blocks = [[3, 4], [7], [8], [9]]
    ticket = issue_ticket(card, "req-1", blocks, 20, nonce=BIG)
    assert ticket == claims.sign(wire.Ticket(engine_id="prefill-a", incarnation=(1 << 62) + 7,
                                             addresses=card.addresses, tp_size=2, request_id="req-1", nonce=BIG,
                                             block_ids=((3, 4), (7,), (8,), (9,)), num_tokens=20, state_position=20,
                                             lease_s=120.0), None)  # signed (engine/claims.py)
    assert ticket.mac and claims.mac_ok(ticket, None)
    assert wire.decode_ticket(wire.encode_ticket(ticket)) == ticket


def test_issue_ticket_draws_a_fresh_nonce_below_2_63():
    card = _card()
    nonces = {issue_ticket(card, "r", [[0], [1], [2], [3]], 5).nonce for _ in range(64)}
    assert len(nonces) == 64
    assert all(0 <= n < 1 << 63 for n in nonces)
    assert max(nonces) > 1 << 53  # 64 draws of 63 bits: all below 2**53 has probability 2**-640


@pytest.mark.parametrize("args, error, field", [
    (("", [[0], [1], [2], [3]], 5), ConfigError, "request_id"),
    (("r", [[0], [1], [2], [3]], -1), ConfigError, "num_tokens"),
    (("r", [[0], [1], [2], [3]], True), ConfigError, "num_tokens"),
])
def test_issue_ticket_refuses_bad_arguments(args, error, field):
    with pytest.raises(error) as info:
        issue_ticket(_card(), *args)
    assert info.value.field == field


@pytest.mark.parametrize("nonce", [-1, 1 << 63, 1.5, True])
def test_issue_ticket_refuses_a_nonce_outside_63_bits(nonce):
    with pytest.raises(ConfigError) as info:
        issue_ticket(_card(), "r", [[0], [1], [2], [3]], 5, nonce=nonce)
    assert info.value.field == "nonce"


@pytest.mark.parametrize("blocks, num_tokens, error", [
    ([[0], [1], [2]], 5, GroupCountError),
    ([[0, 1], [2], [3], [4]], 5, BlockCountError),  # 5 tokens of 16 need exactly one attention block
    ([[0], [0], [2], [3]], 5, DuplicateBlockError),
])
def test_issue_ticket_validates_block_ids_against_the_card(blocks, num_tokens, error):
    with pytest.raises(error):
        issue_ticket(_card(), "r", blocks, num_tokens)


# ---- JSON-safe params ---------------------------------------------------------------------------
def _ticket() -> wire.Ticket:
    return issue_ticket(_card(), "req-json", [[3, 4], [7], [8], [9]], 20, nonce=BIG)


def _big_ints(value) -> list:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value] if abs(value) > 1 << 53 else []
    if isinstance(value, dict):
        return [i for v in value.values() for i in _big_ints(v)]
    if isinstance(value, list):
        return [i for v in value for i in _big_ints(v)]
    return []


def test_params_round_trip_through_json_with_no_integer_above_2_53():
    ticket = _ticket()
    text = json.dumps(ticket_to_params(ticket))
    params = json.loads(text)
    assert _big_ints(params) == []
    assert params["nonce"] == str(BIG) and params["incarnation"] == str((1 << 62) + 7)
    assert ticket_from_params(params) == ticket
    # A router that parses numbers as doubles keeps every number here exactly.
    doubles = json.loads(text, parse_int=float)
    assert ticket_from_params({k: _ints(v) for k, v in doubles.items()}) == ticket


def _ints(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_ints(v) for v in value]
    return value


@pytest.mark.parametrize("field", list(ticket_to_params(_ticket())))
def test_params_refuse_a_missing_field_by_name(field):
    params = json.loads(json.dumps(ticket_to_params(_ticket())))
    del params[field]
    with pytest.raises(TicketParamsError) as info:
        ticket_from_params(params)
    assert info.value.field == field and field in str(info.value)


def test_params_refuse_an_unknown_field_by_name():
    params = ticket_to_params(_ticket()) | {"do_remote_prefill": True}
    with pytest.raises(TicketParamsError) as info:
        ticket_from_params(params)
    assert info.value.field == "do_remote_prefill"


@pytest.mark.parametrize("field, value", [
    ("nonce", BIG),  # a number, not a string: a router would have rounded it
    ("nonce", str(1 << 63)),
    ("nonce", "-5"),
    ("nonce", "12a"),
    ("nonce", "１２"),  # non-ASCII digits
    ("incarnation", 7),
    ("incarnation", str(1 << 64)),
    ("engine_id", ""),
    ("engine_id", 5),
    ("request_id", None),
    ("tp_size", 0),
    ("tp_size", True),
    ("tp_size", 2.0),
    ("addresses", "tcp://a:1"),
    ("addresses", ["tcp://a:1", 3]),
    ("block_ids", [[3, 4], [7], [8], ["9"]]),
    ("block_ids", [[3, -4], [7], [8], [9]]),
    ("block_ids", [3, 4]),
    ("num_tokens", -1),
    ("num_tokens", 20.5),
    ("state_position", "20"),
    ("lease_s", "120"),
    ("lease_s", 0),
    ("lease_s", float("inf")),
    ("version", 1),
    ("version", wire.PROTOCOL_VERSION + 1),
])
def test_params_refuse_a_wrongly_typed_field_by_name(field, value):
    params = ticket_to_params(_ticket()) | {field: value}
    with pytest.raises(TicketParamsError) as info:
        ticket_from_params(params)
    assert info.value.field == field
    assert isinstance(info.value, WireDecodeError)


@pytest.mark.parametrize("params", [None, [], "ticket", 5])
def test_params_refuse_what_is_not_an_object(params):
    with pytest.raises(TicketParamsError):
        ticket_from_params(params)


# ---- hostile params (issue 19 row 2): only typed errors, values cut short, caps on sizes ----------------------
HOSTILE = {
    "huge-version": ("version", 2**100000),
    "huge-tp": ("tp_size", 2**100000),
    "huge-tokens": ("num_tokens", 2**100000),
    "huge-lease": ("lease_s", 2**100000),
    "garbage-address": ("addresses", ["garbage"]),
    "2000-addresses": ("addresses", [f"tcp://127.0.0.1:{5000 + i}" for i in range(2000)]),
    "address-count": ("addresses", ["tcp://10.0.0.1:5600"]),  # the ticket says TP 2
    "twice-the-address": ("addresses", ["tcp://10.0.0.1:5600"] * 2),
    "port-0": ("addresses", ["tcp://10.0.0.1:0", "tcp://10.0.0.1:5601"]),
    "port-99999": ("addresses", ["tcp://10.0.0.1:99999", "tcp://10.0.0.1:5601"]),
    "bad-ipv6": ("addresses", ["tcp://[::g]:5600", "tcp://10.0.0.1:5601"]),
    "url": ("addresses", ["tcp://10.0.0.1:5600/x", "tcp://10.0.0.1:5601"]),
    "10mb-engine-id": ("engine_id", "e" * (10 << 20)),
    "long-request-id": ("request_id", "r" * 5000),
    "huge-block-id": ("block_ids", [[3, 2**100000], [7], [8], [9]]),
    "many-groups": ("block_ids", [[i] for i in range(100)]),
    "many-block-ids": ("block_ids", [[0] * (1 << 20), [1]]),
    "long-mac": ("mac", "ab" * 1000),
    "huge-incarnation": ("incarnation", "9" * 100000),
}


@pytest.mark.parametrize(("field", "value"), list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_params_raise_only_a_typed_error_naming_the_field_with_the_value_cut_short(field, value):
    """Row 2: ``ticket_from_params`` leaked ValueError / OverflowError and let garbage addresses through."""
    params = ticket_to_params(_ticket()) | {field: value}
    with pytest.raises(TicketParamsError) as info:
        ticket_from_params(params)
    assert info.value.field == field
    assert len(str(info.value)) < 600


def test_an_unknown_field_of_any_key_type_is_named_cut_short():
    for key in ("x" * 10000, 2**100000, ("a", 1)):
        params = ticket_to_params(_ticket()) | {key: 1}
        with pytest.raises(TicketParamsError) as info:
            ticket_from_params(params)
        assert len(str(info.value)) < 400 and len(info.value.field) <= 200


def test_params_at_the_caps_still_decode():
    ticket = issue_ticket(EngineCard.from_ranks({r: _rank(r, 64) for r in range(64)}), "req-caps",
                          [[3, 4], [7], [8], [9]], 20)
    assert ticket_from_params(json.loads(json.dumps(ticket_to_params(ticket)))) == ticket
    for host in ("tcp://[::1]:5600", "tcp://prefill-0.example.com:65535", "tcp://localhost:1"):
        params = ticket_to_params(_ticket()) | {"addresses": [host, "tcp://10.0.0.1:5601"]}
        assert ticket_from_params(params).addresses[0] == host
