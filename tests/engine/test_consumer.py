"""Consumer: what it refuses before any byte moves, deadlines on an injected clock, handshake refusals."""

from __future__ import annotations

import itertools

import pytest
import zmq
from harness import TINY, RankSpec, RemoteError, hold_everywhere, start_consumers, start_producers

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, ReadState, wire
from hybrid_transfer.errors import (
    BlockCountError,
    BlockIdError,
    HandshakeTimeout,
    ReadDeadlineError,
    RequestStateError,
    StatePositionError,
    TicketError,
)
from hybrid_transfer.layout import CacheOptions, ConvLayout, DType, RankGeometry, model_from_config
from hybrid_transfer.verify import RequestLayout

MODEL = model_from_config(TINY, name="tiny")
LOCAL = [[1, 2], [3], [4], [5]]


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def silent_address():
    """A bound ROUTER that never answers: handshakes to it wait until their deadline."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield f"tcp://127.0.0.1:{port}"
    ctx.destroy(linger=0)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def consumer(clock):
    config = EngineConfig(handshake_timeout_s=5.0, read_deadline_s=30.0)
    c = Consumer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock)
    yield c
    c.close()


def _ticket(address: str, **changes) -> wire.Ticket:
    fields = dict(engine_id="prefill", incarnation=1, addresses=(address,), tp_size=1, request_id="r", nonce=9,
                  block_ids=((6, 7), (8,), (9,), (10,)), num_tokens=20, state_position=20, lease_s=60.0)
    return wire.Ticket(**(fields | changes))


def test_a_state_position_other_than_expected_is_refused_before_anything(consumer, silent_address):
    with pytest.raises(StatePositionError) as info:
        consumer.start_read(_ticket(silent_address), LOCAL, expected_state_position=19)
    assert (info.value.expected, info.value.actual) == (19, 20)
    assert consumer.num_active == 0 and not consumer.poll()
    # The N-1 contract: a prompt of 21 tokens moves 20; the caller that expects 20 is served.
    consumer.start_read(_ticket(silent_address), LOCAL, expected_state_position=20)
    assert consumer.is_active("r")


@pytest.mark.parametrize(("changes", "match"), [
    ({"state_position": 19}, "state position 19"),
    ({"tp_size": 2}, "addresses for TP 2"),
])
def test_inconsistent_tickets_are_refused(consumer, silent_address, changes, match):
    with pytest.raises(TicketError, match=match):
        consumer.start_read(_ticket(silent_address, **changes), LOCAL)
    assert consumer.num_active == 0


@pytest.mark.parametrize(("local", "error"), [
    ([[1], [3], [4], [5]], BlockCountError),  # 20 tokens need at least 2 local attention blocks
    ([[1, 2], [3], [4], [16]], BlockIdError),
])
def test_bad_local_blocks_are_refused(consumer, silent_address, local, error):
    with pytest.raises(error):
        consumer.start_read(_ticket(silent_address), local)
    assert consumer.num_active == 0


def test_a_request_id_is_read_once(consumer, silent_address):
    consumer.start_read(_ticket(silent_address), LOCAL)
    with pytest.raises(RequestStateError, match="already being read"):
        consumer.start_read(_ticket(silent_address), [[11, 12], [13], [14], [15]])


def test_an_unanswered_handshake_fails_its_requests_at_the_timeout(consumer, clock, silent_address):
    consumer.start_read(_ticket(silent_address), LOCAL)  # returns at once: the request waits for the peer
    assert consumer.poll() == []
    clock.now += 4.9
    assert consumer.poll() == [] and consumer.is_active("r")
    clock.now += 0.2
    (result,) = consumer.poll()
    assert result.state is ReadState.FAILED and isinstance(result.error, HandshakeTimeout)
    assert result.local_block_ids == ((1, 2), (3,), (4,), (5,)) and not result.ok
    # A timeout may heal, after a backoff: until then a ticket for that engine fails at once naming the cause.
    with pytest.raises(HandshakeTimeout) as info:
        consumer.start_read(_ticket(silent_address, request_id="r2"), LOCAL)
    assert info.value.cause == "timeout" and "next handshake in 0.5 s" in str(info.value)
    assert not consumer.is_active("r2")
    clock.now += 0.5
    consumer.start_read(_ticket(silent_address, request_id="r2"), LOCAL)  # a fresh handshake
    assert consumer.poll() == [] and consumer.is_active("r2")


def test_the_read_deadline_bounds_the_wait_for_a_peer(clock, silent_address):
    config = EngineConfig(handshake_timeout_s=60.0, read_deadline_s=2.0)
    with Consumer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock) as c:
        c.start_read(_ticket(silent_address), LOCAL)
        clock.now += 2.0
        (result,) = c.poll()
        assert isinstance(result.error, ReadDeadlineError) and result.error.state == "waiting_peer"


def test_connect_gives_up_at_its_timeout(silent_address):
    ticks = itertools.count(0.0, 0.5)
    with Consumer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), clock=lambda: next(ticks)) as c:
        with pytest.raises(HandshakeTimeout) as info:
            c.connect(silent_address, timeout_s=3.0)
        assert info.value.address == silent_address


# One case per class of equal-tier field (docs/wire.md#handshake), each against the same producer engine.
MISMATCHES = {
    "conv layout": (TINY, CacheOptions(conv_layout=ConvLayout.SD), "conv_layout", "SD", "DS"),
    "dtype": (TINY, CacheOptions(kv_dtype=DType.FP16), "kv_dtype", "float16", "bfloat16"),
    "model dimension": ({**TINY, "linear_num_value_heads": 16}, None, "linear_num_value_heads", 16, 8),
    "layer map": ({**TINY, "layer_types": ["full_attention"] * 2 + ["linear_attention"] * 6}, None,
                  "layer_tensor", [0, 1, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]),
}


def test_handshake_mismatches_fail_before_any_transfer(cluster):
    """connect() and a ticket both fail, naming the field with both values; no byte moves, nothing is freed."""
    p_worker, c_workers = cluster.workers[0], cluster.workers[1:5]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)])
    specs = [RankSpec(model, 1, 0, 16, options) for model, options, *_ in MISMATCHES.values()]
    consumer_engines = [start_consumers([w], [s]) for w, s in zip(c_workers, specs, strict=True)]
    try:
        layout = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
        ticket = hold_everywhere(producers, "r", layout, seed=3)
        for (case, (_, _, field, c_value, p_value)), engine in zip(MISMATCHES.items(), consumer_engines,
                                                                  strict=True):
            w, k = engine.workers[0], engine.keys[0]
            if case == "dtype":  # the automatic path: a ticket naming a new engine, no connect()
                w.call("start_read", k, ticket, [[5, 6], [7], [8], [9]], 20)
                (result,) = w.call("wait_done", k, ["r"], 20.0)
                assert result.state == "failed" and result.error_type == "HandshakeError", result
                message = result.error_message
            else:
                with pytest.raises(RemoteError) as info:
                    w.call("connect", k, producers.addresses[0], 10.0)
                assert info.value.type_name == "HandshakeError"
                found = {name: (list(c) if isinstance(c, (list, tuple)) else c,
                                list(p) if isinstance(p, (list, tuple)) else p)
                         for name, c, p in info.value.attrs["differences"]}
                assert found[field] == (c_value, p_value)
                message = info.value.message
                with pytest.raises(RemoteError) as again:  # the engine is now known to be incompatible
                    w.call("start_read", k, ticket, [[5, 6], [7], [8], [9]], 20)
                assert again.value.type_name == "HandshakeError"
            assert field in message and repr(c_value) in message and repr(p_value) in message, message
            w.call("check", k, [])  # the whole cache still holds poison: not one byte arrived
        status = p_worker.call("producer_status", producers.keys[0], ["r"])
        assert status["held"] == ["r"] and status["stats"]["completions"] == 0
        listener = status["listener"]
        assert (listener["accepted"], listener["rejected"], listener["garbage"]) == (0, 4, 0)
    finally:
        producers.close()
        for engine in consumer_engines:
            engine.close()


def test_connect_then_read_at_different_tp_and_block_sizes(cluster):
    producers = start_producers(cluster.workers[:2], [RankSpec(TINY, 2, r, 16) for r in range(2)])
    consumers = start_consumers(cluster.workers[2:3], [RankSpec(TINY, 1, 0, 16, CacheOptions(block_size=48))])
    try:
        w, k = consumers.workers[0], consumers.keys[0]
        w.call("connect", k, producers.addresses[1], 10.0)  # any rank's address finds the whole engine
        layout = RequestLayout(((0, 1, 2), (3,), (4,), (5,)), 40)
        ticket = hold_everywhere(producers, "r", layout, seed=8)
        local = RequestLayout(((9,), (10,), (11,), (12,)), 40)
        w.call("start_read", k, ticket, local.block_ids, 40)
        assert w.call("wait_done", k, ["r"], 20.0)[0].state == "done"
        w.call("check", k, [(local, 8)])
        for pw, pk in zip(producers.workers, producers.keys, strict=True):
            assert pw.call("wait_freed", pk, ["r"], 20.0) == ["r"]
    finally:
        producers.close()
        consumers.close()
