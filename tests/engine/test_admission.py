"""The consumer's admission fast paths (engine/inputs.py, claims.py, addresses.py) against their slow forms.

Each fast path must accept exactly what the step-by-step checks accept and hand back the same values: the
honest-ticket round trip and the named checks, the one-call block id check and the per-group loop, the
digest inputs.ticket leaves for digest_of and claims' own encoding,
and the cached allowed_producers verdicts and the rules. No sockets here.
"""

from __future__ import annotations

import enum
import hashlib
import hmac

import msgspec
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.engine import addresses as addresses_module
from hybrid_transfer.engine import claims, inputs, wire
from hybrid_transfer.engine.addresses import DEFAULT_ALLOWED_PRODUCERS, AllowedProducers
from hybrid_transfer.errors import PlanError, TicketError

ADDRESS = "tcp://127.0.0.1:5600"


def _ticket(**fields) -> wire.Ticket:
    base = {"engine_id": "prefill", "incarnation": 7, "addresses": (ADDRESS,), "tp_size": 1, "request_id": "r",
            "nonce": 11, "block_ids": ((1, 2, 3), (4,)), "num_tokens": 40, "state_position": 40, "lease_s": 30.0}
    return wire.Ticket(**(base | fields))


def _old_digest(t: wire.Ticket) -> bytes:
    """claims.ticket_digest as it was written before the fast paths: the reference."""
    fields = (t.engine_id, t.incarnation, t.request_id, t.nonce, [list(g) for g in t.block_ids], t.num_tokens,
              t.state_position)
    return hashlib.sha256(b"hybrid-transfer ticket\0" + msgspec.msgpack.encode(fields)).digest()


class Colour(enum.Enum):  # msgspec encodes a member as its value; the checks must not take it for an int
    RED = 1


class Small(enum.IntEnum):
    ONE = 1


# ---- tickets: the honest round trip and the named checks ---------------------------------------------------
_IDS = st.sampled_from([0, 1, 5, 1000, inputs.MAX_BLOCK_ID, inputs.MAX_BLOCK_ID + 1, -1, True, 1.5, None, "3",
                        np.int64(3), Small.ONE, Colour.RED, 1 << 64, 1 << 70])
_GROUP = st.one_of(st.lists(_IDS, max_size=4), st.lists(_IDS, max_size=4).map(tuple),
                   st.sampled_from(["ab", b"ab", {1, 2}, np.arange(3), range(3), 5, None]))
_GROUPS = st.one_of(st.lists(_GROUP, max_size=4), st.lists(_GROUP, max_size=4).map(tuple),
                    st.just(((1,),) * (inputs.MAX_TICKET_GROUPS + 1)), st.sampled_from([None, "x", {(1,)}]))
_ADDRESS_POOL = st.sampled_from([ADDRESS, "tcp://127.0.0.1:5601", "tcp://[::1]:9", "tcp://host.example:1",
                                 "garbage", "tcp://h:0", "tcp://" + "a" * 300 + ":1", 5, None, b"tcp://h:1"])
_ADDRESSES = st.one_of(st.lists(_ADDRESS_POOL, max_size=3).map(tuple), st.lists(_ADDRESS_POOL, max_size=3),
                       st.just((ADDRESS,) * (inputs.MAX_TICKET_RANKS + 1)), st.sampled_from([ADDRESS, None]))
_NONCES = st.sampled_from([0, 1, wire.MAX_NONCE, wire.MAX_NONCE + 1, -1, 1 << 64, 1 << 700, True, 1.0, "1", None])
_TOKENS = st.sampled_from([0, 8, 40, inputs.MAX_TICKET_TOKENS, inputs.MAX_TICKET_TOKENS + 1, -1, True, 8.0,
                           Small.ONE, 1 << 80])
_TEXT = st.one_of(st.text(max_size=6), st.sampled_from(["", "x" * 257, "r" * 1025, 5, None, b"r"]))
TICKETS = st.builds(
    wire.Ticket, engine_id=_TEXT, incarnation=_NONCES, addresses=_ADDRESSES,
    tp_size=st.sampled_from([1, 2, 3, inputs.MAX_TICKET_RANKS, inputs.MAX_TICKET_RANKS + 1, 0, True, 1.0]),
    request_id=_TEXT, nonce=_NONCES, block_ids=_GROUPS, num_tokens=_TOKENS, state_position=_TOKENS,
    lease_s=st.sampled_from([30.0, 1, 0.0, -1.0, "30", float("inf")]),
    version=st.sampled_from([wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION - 1, True]),
    mac=st.sampled_from([b"", b"m" * 32, b"m" * (wire.MAX_AUTH_BYTES + 1), "mac"]))
HONEST = st.builds(
    wire.Ticket, engine_id=st.text(min_size=1, max_size=20), incarnation=st.integers(0, wire.MAX_NONCE),
    addresses=st.sets(st.integers(1, 65535), min_size=1, max_size=8).map(
        lambda ports: tuple(f"tcp://10.0.0.{p % 250}:{p}" for p in sorted(ports))),
    tp_size=st.integers(1, 8), request_id=st.text(min_size=1, max_size=40), nonce=st.integers(0, wire.MAX_NONCE),
    block_ids=st.lists(st.lists(st.integers(0, inputs.MAX_BLOCK_ID), max_size=80).map(tuple), max_size=6).map(tuple),
    num_tokens=st.integers(0, inputs.MAX_TICKET_TOKENS), state_position=st.integers(0, inputs.MAX_TICKET_TOKENS),
    lease_s=st.floats(1e-3, 1e6), mac=st.binary(max_size=32))


def _stepwise(t: wire.Ticket):
    try:
        return inputs._stepwise_ticket(t)
    except TicketError as exc:
        return exc


@settings(max_examples=1500, deadline=None)
@given(TICKETS)
def test_the_honest_ticket_path_accepts_exactly_what_the_named_checks_accept(t):
    fast, slow = inputs._honest_ticket(t), _stepwise(t)
    if fast is None:  # a set for the tuple of groups or addresses is left to the named checks (which take it)
        if type(t.block_ids) in (list, tuple) and type(t.addresses) in (list, tuple):
            assert isinstance(slow, TicketError), f"the fast path refused a ticket the named checks take: {t!r}"
    else:
        assert not isinstance(slow, Exception), f"the fast path took a ticket the named checks refuse: {slow}"
        assert type(fast) is wire.Ticket and wire.encode_ticket(fast) == wire.encode_ticket(slow)


@settings(max_examples=300, deadline=None)
@given(HONEST)
def test_an_honest_ticket_passes_the_fast_path_and_its_digest_is_the_old_one(t):
    assert inputs._honest_ticket(t) is not None
    checked = inputs.ticket(t)
    assert checked == t and checked is not t
    assert claims.digest_of(checked) == _old_digest(t) == claims.digest_of(checked)
    assert claims.ticket_digest(t.engine_id, t.incarnation, t.request_id, t.nonce, t.block_ids, t.num_tokens,
                                t.state_position) == _old_digest(t)


def test_the_digest_left_for_digest_of_belongs_to_the_ticket_it_names():
    first, second = inputs.ticket(_ticket(request_id="a")), inputs.ticket(_ticket(request_id="b"))
    assert claims.digest_of(first) == _old_digest(first)  # not the last one checked: encoded again
    assert claims.digest_of(second) == _old_digest(second) != _old_digest(first)
    lists = _ticket(block_ids=[[1, 2, 3], (4,)], addresses=[ADDRESS])  # lists and tuples encode alike
    assert claims.digest_of(inputs.ticket(lists)) == _old_digest(_ticket())
    enums = _ticket(block_ids=((Small.ONE, 2, 3), (4,)))  # decoded to plain ints, as check_ticket does
    checked = inputs.ticket(enums)
    assert type(checked.block_ids[0][0]) is int and claims.digest_of(checked) == _old_digest(_ticket(
        block_ids=((1, 2, 3), (4,))))


def test_the_fast_path_parts_cover_every_ticket_field_once():
    fields = (*claims.DIGEST_FIELDS, *inputs._REST_FIELDS)
    assert sorted(fields) == sorted(wire.Ticket.__struct_fields__) and len(set(fields)) == len(fields)
    assert set(inputs._TIGHTER) <= set(wire.Ticket.__struct_fields__)


def test_a_ticket_subclass_or_a_bad_value_still_gets_the_named_error():
    with pytest.raises(TicketError, match=r"block_ids\[0\]\[1\]=2147483648"):
        inputs.ticket(_ticket(block_ids=((1, inputs.MAX_BLOCK_ID + 1),)))
    with pytest.raises(TicketError, match="tp_size=65"):
        inputs.ticket(_ticket(tp_size=65))
    with pytest.raises(TicketError, match="names one address twice"):
        inputs.ticket(_ticket(addresses=(ADDRESS, ADDRESS), tp_size=2))
    with pytest.raises(TicketError, match="protocol version"):
        inputs.ticket(_ticket(version=wire.PROTOCOL_VERSION - 1))
    # msgpack writes an Enum member as its value: the round trip (wire.check_ticket's too) keeps the plain int.
    assert inputs.ticket(_ticket(block_ids=((Colour.RED,),))).block_ids == ((1,),)

    class Longer(wire.Ticket):  # a subclass may carry fields a Ticket has not: the named checks judge it
        extra: int = 0

    longer = Longer(**{f: getattr(_ticket(), f) for f in wire.Ticket.__struct_fields__}, extra=5)
    assert inputs._honest_ticket(longer) is None
    with pytest.raises(TicketError, match="unknown field `extra`"):
        inputs.ticket(longer)


def test_a_group_whose_len_raises_is_a_ticket_error():
    class Hostile:
        def __len__(self):
            raise ValueError("no")

    with pytest.raises(TicketError, match="cannot be encoded"):
        inputs.ticket(_ticket(block_ids=(Hostile(),)))


def test_lists_nested_past_the_recursion_limit_are_a_ticket_error():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(TicketError, match="cannot be encoded"):
        inputs.ticket(_ticket(block_ids=(deep,)))


# ---- block ids: one msgspec call and the per-group loop -----------------------------------------------------
_LOCAL = st.one_of(st.lists(_GROUP, max_size=5), st.lists(_GROUP, max_size=5).map(tuple),
                   st.sampled_from([None, "ab", np.zeros((2, 2), dtype=np.int64), {(1,)}]))
_LOCAL_IDS = st.sampled_from([0, 7, (1 << 63) - 1, -(1 << 63) + 1, -(1 << 63), 1 << 63, True, np.bool_(True),
                              np.int64(3), 2.0, Small.ONE, Colour.RED, None])


def _outcome(groups, fast: bool, monkeypatch):
    with monkeypatch.context() as patch:
        if not fast:
            patch.setattr(inputs, "_plain_id_lists", lambda _groups: False)
        try:
            inputs.block_id_lists("local", groups)
        except PlanError as exc:
            return str(exc)
    return None


@settings(max_examples=800, deadline=None)
@given(st.one_of(_LOCAL, st.lists(st.lists(_LOCAL_IDS, max_size=4), max_size=4)))
def test_block_id_lists_fast_path_refuses_what_the_loop_refuses_with_the_same_message(groups):
    with pytest.MonkeyPatch.context() as monkeypatch:
        assert _outcome(groups, True, monkeypatch) == _outcome(groups, False, monkeypatch)
    if inputs._plain_id_lists(groups):
        assert all(type(g) in (list, tuple) for g in groups)


def test_block_id_lists_fast_path_takes_the_usual_lists_and_nothing_else():
    assert inputs._plain_id_lists([[0, 7, (1 << 63) - 1, -(1 << 63) + 1], (), [3, 4]])
    for groups in ([[1, True]], [[np.int64(3)]], [[Colour.RED]], [[1 << 63]], [[-(1 << 63)]], [{1, 2}],
                   [np.arange(3)], [range(3)], "ab", None, {(1,)}):
        assert not inputs._plain_id_lists(groups), groups


@settings(max_examples=100, deadline=None)
@given(HONEST, st.binary(min_size=1, max_size=64))
def test_a_ticket_mac_is_hmac_sha256_of_the_digest_under_the_ticket_key(t, secret):
    key = claims.ticket_key(secret, t.engine_id, t.incarnation)
    expected = hmac.digest(key, _old_digest(t), "sha256")
    assert claims.ticket_mac(t, secret) == expected
    signed = claims.sign(t, secret)
    checked = inputs.ticket(signed)
    assert claims.mac_ok(checked, secret, claims.digest_of(checked))
    assert not claims.mac_ok(checked, secret + b"x", claims.digest_of(checked))
    edited = inputs.ticket(msgspec.structs.replace(signed, nonce=(t.nonce + 1) % wire.MAX_NONCE))
    assert not claims.mac_ok(edited, secret, claims.digest_of(edited))


# ---- allowed_producers: cached verdicts and the rules ---------------------------------------------------------
def test_a_refused_address_stays_refused_and_an_allowed_one_allowed():
    allowed = AllowedProducers(DEFAULT_ALLOWED_PRODUCERS)
    for _ in range(3):
        assert allowed.allows(ADDRESS) and allowed.allows("tcp://localhost:1")
        assert not allowed.allows("tcp://10.0.0.1:5600") and not allowed.allows("garbage")
    assert allowed._verdicts == {ADDRESS: True, "tcp://localhost:1": True, "tcp://10.0.0.1:5600": False,
                                 "garbage": False}


def test_the_verdict_cache_is_bounded_and_keeps_only_short_exact_strings():
    allowed = AllowedProducers(["10.0.0.0/8"])
    n = addresses_module.MAX_VERDICTS
    for i in range(3 * n):
        assert allowed.allows(f"tcp://10.{i // 65536 % 256}.{i // 256 % 256}.{i % 256}:5600")
        assert not allowed.allows(f"tcp://11.0.{i // 256 % 256}.{i % 256}:5600")
    assert len(allowed._verdicts) == n
    assert "tcp://10.0.0.0:5600" not in allowed._verdicts  # the oldest went first
    assert allowed.allows("tcp://10.0.0.0:5600") and not allowed.allows("tcp://11.0.0.0:5600")

    class Sly(str):  # a str subclass could hash or compare as it likes: never a key
        pass

    fresh = AllowedProducers(["10.0.0.0/8"])
    long_one = "tcp://" + "a" * 10_000 + ":1"
    assert not fresh.allows(long_one) and not fresh.allows(long_one)
    assert fresh.allows(Sly("tcp://10.0.0.1:1")) and not fresh.allows(["tcp://10.0.0.1:1"]) and not fresh.allows(None)
    assert fresh._verdicts == {}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.builds(lambda a, b, p: f"tcp://{a}.0.0.{b}:{p}", st.sampled_from([10, 127, 192]), st.integers(0, 300),
              st.integers(0, 70000)),
    st.sampled_from(["tcp://localhost:1", "tcp://LOCALHOST:2", "tcp://[::1]:3", "tcp://[::2]:3", "tcp://h-1.x:5600",
                     "tcp://h-1.x:5601", "garbage", ""])), max_size=12))
def test_cached_verdicts_equal_the_rules(addresses):
    allowed = AllowedProducers(["10.0.0.0/24:5600-5700", "127.0.0.0/8", "::1", "localhost", "h-1.x:5600"])
    for address in addresses + addresses:  # the second pass answers from the cache
        assert allowed.allows(address) == allowed._judge(address), address
