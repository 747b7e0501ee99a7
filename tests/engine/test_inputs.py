"""Strict API input (issue 14, row 8): wrong types refused with the value named, before anything is pinned."""

from __future__ import annotations

import numpy as np
import pytest
import zmq
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, Producer, wire
from hybrid_transfer.errors import ConfigError, PlanError, TicketError, WireDecodeError
from hybrid_transfer.layout import RankGeometry, model_from_config

MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
IDS = [[1], [2], [3], [4]]


@pytest.fixture(scope="module")
def producer():
    p = Producer(HybridCache.allocate(GEOMETRY, 16))
    yield p
    p.close()


@pytest.mark.parametrize(("kwargs", "field", "shown"), [
    ({"num_tokens": True}, "num_tokens", "True"),
    ({"num_tokens": 4.0}, "num_tokens", "4.0"),
    ({"num_tokens": "4"}, "num_tokens", "'4'"),
    ({"request_id": 12345}, "request_id", "12345"),
    ({"request_id": b"r"}, "request_id", "b'r'"),
    ({"request_id": ""}, "request_id", "''"),
    ({"request_id": "r" * (wire.MAX_REQUEST_ID_CHARS + 1)}, "request_id", "1025"),
    ({"nonce": 2**64}, "nonce", str(2**64)),
    ({"nonce": 2**63}, "nonce", str(2**63)),
    ({"nonce": -1}, "nonce", "-1"),
    ({"nonce": True}, "nonce", "True"),
    ({"nonce": 1.5}, "nonce", "1.5"),
], ids=lambda v: repr(v)[:24] if not isinstance(v, dict) else next(iter(v)))
def test_hold_refuses_a_wrong_type_or_range_naming_the_value(producer, kwargs, field, shown):
    args = {"request_id": "r", "block_ids_per_group": IDS, "num_tokens": 4} | kwargs
    before = producer.num_held_blocks
    with pytest.raises(ConfigError) as info:
        producer.hold(**args)
    assert info.value.field == field and shown in str(info.value)
    assert producer.num_held_blocks == before and producer.num_held_requests == 0


@pytest.mark.parametrize("block_ids", [
    [[1, True], [2], [3], [4]],
    [[1], [np.bool_(True)], [3], [4]],
    [[1], [2.0], [3], [4]],
    [[1], ["2"], [3], [4]],
    [[1], [None], [3], [4]],
    [[1], [2], [3], 4],
])
def test_hold_refuses_block_ids_that_are_not_integers(producer, block_ids):
    with pytest.raises(PlanError, match="integer"):
        producer.hold("r", block_ids, 4)
    assert producer.num_held_blocks == 0 and not producer.is_held("r")


@pytest.mark.parametrize("ids", [[1, 2, True], (3, False), [1 << 63], [-(1 << 63)], [5, 1 << 200], [2, np.int64(3), 1.0]])
def test_the_fast_path_for_plain_int_lists_refuses_what_the_loop_refuses(ids):
    # block_id_lists checks a list of exact ints in C (set, min, max); a bool, an id beyond int64 or another
    # type among them must still reach the per-id loop and be refused there, named.
    from hybrid_transfer.engine import inputs

    with pytest.raises(PlanError, match="integers|out of range"):
        inputs.block_id_lists("local", [ids])
    inputs.block_id_lists("local", [[0, 7, (1 << 63) - 1, -(1 << 63) + 1], (), [np.int64(3), 4]])


def test_numpy_integers_are_integers(producer):
    ticket = producer.hold(
        "np", [np.array([1], dtype=np.int32), [np.int64(2)], [3], [4]], np.int64(4), nonce=np.uint64(7))
    try:
        assert ticket.nonce == 7 and type(ticket.num_tokens) is int and type(ticket.block_ids[0][0]) is int
        assert wire.decode_ticket(wire.encode_ticket(ticket)) == ticket
    finally:
        producer.abort("np")
        producer.poll()


@pytest.mark.parametrize(("kwargs", "field"), [({"engine_id": "e" * (wire.MAX_NAME_CHARS + 1)}, "engine_id"),
                                               ({"engine_id": 7}, "engine_id"),
                                               ({"incarnation": -1}, "incarnation"),
                                               ({"incarnation": 2**63}, "incarnation"),
                                               ({"incarnation": True}, "incarnation")])
def test_a_producer_identity_that_no_ticket_could_carry_is_refused(kwargs, field):
    with pytest.raises(ConfigError) as info:
        Producer(HybridCache.allocate(GEOMETRY, 4), **kwargs)
    assert info.value.field == field


# ---- the consumer: start_read -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def silent_address():
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def consumer():
    c = Consumer(HybridCache.allocate(GEOMETRY, 16))
    yield c
    c.close()


def _ticket(address: str, **changes) -> wire.Ticket:
    fields = dict(engine_id="prefill", incarnation=1, addresses=(address,), tp_size=1, request_id="r", nonce=9,
                  block_ids=((6,), (8,), (9,), (10,)), num_tokens=4, state_position=4, lease_s=60.0)
    return wire.Ticket(**(fields | changes))


@pytest.mark.parametrize(("changes", "shown"), [
    ({"num_tokens": True, "state_position": True}, "num_tokens=True"),
    ({"request_id": 12345}, "request_id=12345"),
    ({"nonce": 2**64}, f"nonce={2**64}"),
    ({"nonce": -3}, "nonce=-3"),
    ({"block_ids": ((6, True), (8,), (9,), (10,))}, "block_ids[0][1]=True"),
    ({"tp_size": 0, "addresses": ()}, "tp_size=0"),
    ({"lease_s": -1.0}, "lease_s=-1.0"),
    ({"engine_id": "e" * 300}, "engine_id="),
], ids=["bool-tokens", "int-request-id", "nonce-2**64", "negative-nonce", "bool-block-id", "tp-0", "lease",
        "long-engine-id"])
def test_start_read_refuses_an_ill_typed_ticket_naming_the_field_and_value(consumer, silent_address, changes,
                                                                            shown):
    with pytest.raises(TicketError) as info:
        consumer.start_read(_ticket(silent_address, **changes), [[1], [2], [3], [4]])
    assert shown in str(info.value)
    assert consumer.num_active == 0 and not consumer.poll()


@pytest.mark.parametrize("local", [[[1, True], [2], [3], [4]], [[1], [2.5], [3], [4]], [[1], [2], [3], "4"]])
def test_start_read_refuses_local_block_ids_that_are_not_integers(consumer, silent_address, local):
    with pytest.raises(PlanError, match="integer"):
        consumer.start_read(_ticket(silent_address), local)
    assert consumer.num_active == 0


@pytest.mark.parametrize("expected", [True, 4.0, "4", -1])
def test_start_read_refuses_an_expected_state_position_that_is_not_a_count(consumer, silent_address, expected):
    with pytest.raises(ConfigError) as info:
        consumer.start_read(_ticket(silent_address), [[1], [2], [3], [4]], expected_state_position=expected)
    assert info.value.field == "expected_state_position" and repr(expected) in str(info.value)
    assert consumer.num_active == 0


def test_start_read_refuses_what_is_not_a_ticket(consumer):
    with pytest.raises(TicketError, match="bytes"):
        consumer.start_read(b"ticket bytes", [[1], [2], [3], [4]])  # type: ignore[arg-type]


# ---- tickets from bytes -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("changes", "shown"), [
    ({"num_tokens": -1, "state_position": -1}, "num_tokens=-1"),
    ({"state_position": -1}, "state_position=-1"),
    ({"tp_size": 0}, "tp_size=0"),
    ({"nonce": -1}, "nonce=-1"),
    ({"block_ids": ((6,), (-8,), (9,), (10,))}, "block_ids[1][0]=-8"),
    ({"lease_s": 0.0}, "lease_s=0.0"),
    ({"request_id": "r" * 2000}, "request_id="),
])
def test_a_ticket_with_an_invalid_field_is_refused_at_decode_naming_it(changes, shown):
    data = wire.encode_ticket(_ticket("tcp://127.0.0.1:1", **changes))
    with pytest.raises(WireDecodeError) as info:
        wire.decode_ticket(data)
    message = str(info.value)
    assert shown in message and "state position" not in message  # not the misleading N-1 message


# ---- hostile tickets (issue 19 row 2): a typed error before any socket, connect or pin ------------------------
HOSTILE_TICKETS = {
    "huge-tp": {"tp_size": 2**100000},
    "huge-version": {"version": 2**100000},
    "huge-nonce": {"nonce": 2**100000},
    "huge-block-id": {"block_ids": ((6, 2**100000), (8,), (9,), (10,))},
    "garbage-address": {"addresses": ("garbage",)},
    "port-0": {"addresses": ("tcp://127.0.0.1:0",)},
    "2000-addresses": {"tp_size": 2000, "addresses": tuple(f"tcp://127.0.0.1:{5000 + i}" for i in range(2000))},
    "100-groups": {"block_ids": tuple((i,) for i in range(100))},
    "not-allowed": {"addresses": ("tcp://10.9.8.7:5600",)},
}


@pytest.fixture
def fresh_consumer():
    c = Consumer(HybridCache.allocate(GEOMETRY, 16))
    yield c
    c.close()


@pytest.mark.parametrize("changes", list(HOSTILE_TICKETS.values()), ids=list(HOSTILE_TICKETS))
def test_a_hostile_ticket_fails_alone_with_a_typed_error_before_any_socket(fresh_consumer, silent_address, changes):
    """Row 2: an untyped zmq.ZMQError escaped start_read, a ValueError came from the error message's path, and
    2,000 addresses opened as many sockets."""
    c = fresh_consumer
    for call in (lambda t: c.start_read(t, [[1], [2], [3], [4]]), c.decline):
        with pytest.raises(TicketError) as info:
            call(_ticket(silent_address, **changes))
        assert len(str(info.value)) < 800
        assert c.num_active == 0 and c.num_handshake_sockets == 0 and c.num_links == 0
    c.start_read(_ticket(silent_address), [[1], [2], [3], [4]])  # the consumer is unharmed: the next ticket goes on
    assert c.is_active("r") and c.num_handshake_sockets == 1
