"""Hypothesis against what a client's request can carry to a decode worker (issue 19, Deliver 3).

``ticket_from_params`` and ``Consumer.start_read`` / ``decline`` get drawn tickets, honest or hostile
field by field; every outcome must be a ticket, a started request or one of our typed errors. The
consumer is ONE long-lived real Consumer (a NIXL agent with UCX) with an injected clock and a short
handshake timeout: addresses are loopback ports that never answer (or refuse the TCP connection), so
no example waits on the network; the clock is moved past each example's deadlines instead. Afterwards
its open file descriptors, links and handshake sockets are back at their starting values.
"""

from __future__ import annotations

import os
import time

import pytest
import zmq
from harness import TINY
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, claims, wire
from hybrid_transfer.engine.ticket_params import ticket_from_params, ticket_to_params
from hybrid_transfer.errors import HybridTransferError, TicketParamsError
from hybrid_transfer.layout import RankGeometry, model_from_config

MODEL = model_from_config(TINY, name="tiny")
PARAMS_EXAMPLES = 400  # max_examples of the ticket_from_params fuzz (about 1 s)
READ_EXAMPLES = 150  # max_examples of the start_read / decline fuzz (about 5 s on the 2-core CI host)
TIMEOUT_S = 0.5  # the consumer's handshake timeout, on its injected clock


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _free_port() -> int:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ctx.destroy(linger=0)
    return port


@pytest.fixture(scope="module")
def silent():
    """Two loopback ports that accept connections and never answer, and two where nothing listens."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    listening = [f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}" for _ in range(2)]
    closed = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(2)]
    yield listening + closed
    ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def fuzzed(silent):
    clock = FakeClock()
    config = EngineConfig(handshake_timeout_s=TIMEOUT_S, read_deadline_s=2 * TIMEOUT_S, max_links=4,
                          max_handshake_sockets=4)
    consumer = Consumer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16), config, clock=clock)
    yield consumer, clock
    consumer.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _drain(consumer: Consumer, clock: FakeClock, seconds: float) -> None:
    """Move the clock past every deadline (and, with ``seconds`` large, every backoff) and report what ended."""
    clock.now += seconds
    for _ in range(3):
        consumer.poll()


HUGE = 2**100000
hostile_scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2**70), max_value=2**70), st.just(HUGE),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40), st.binary(max_size=40))
hostile_values = st.one_of(hostile_scalars, st.lists(hostile_scalars, max_size=5),
                           st.dictionaries(st.text(max_size=5), hostile_scalars, max_size=3))


def _addresses(silent: list[str]):
    one = st.one_of(
        st.sampled_from(silent),
        st.sampled_from(["tcp://10.1.2.3:5600", "garbage", "tcp://127.0.0.1:0", "tcp://127.0.0.1:99999",
                         "tcp://[::g]:1", "udp://127.0.0.1:5600", "tcp://127.0.0.1:5600/x", ""]),
        st.text(max_size=30))
    return st.one_of(st.lists(one, min_size=1, max_size=3), st.just([silent[0]] * 70))


@st.composite
def _fields(draw, silent: list[str]):
    """Ticket fields: an honest ticket of a few engines half the time, else one with one or two fields replaced by
    anything at all (hostile scalars and containers, garbage or foreign addresses, 70 of them)."""
    addresses = draw(st.lists(st.sampled_from(silent), min_size=1, max_size=2, unique=True))
    fields = {
        "engine_id": draw(st.sampled_from(["pa", "pb", "pc"])),
        "incarnation": draw(st.sampled_from([1, 2])),
        "addresses": addresses,
        "tp_size": len(addresses),
        "request_id": draw(st.sampled_from(["r0", "r1", "r2"])),
        "nonce": draw(st.integers(min_value=0, max_value=2**63 - 1)),
        "block_ids": draw(st.sampled_from([[[6, 7], [8], [9], [10]], [[6], [8], [9], [10]], [[6, 7], [8], [9]],
                                           [[6, 7], [8], [9], [99]]])),
        "num_tokens": draw(st.sampled_from([20, 20, 4, 0])),
        "lease_s": 60.0,
        "version": wire.PROTOCOL_VERSION,
        "signed": draw(st.booleans()),
    }
    if draw(st.booleans()):
        for key in draw(st.lists(st.sampled_from([k for k in fields if k != "signed"]), min_size=1, max_size=2)):
            fields[key] = draw(_addresses(silent) if key == "addresses" else hostile_values)
    return fields


def _ticket(fields: dict) -> wire.Ticket:
    fields = dict(fields)
    signed = fields.pop("signed")
    for key in ("addresses", "block_ids"):  # as a decoder would build them, when they are lists
        if isinstance(fields[key], list):
            fields[key] = tuple(tuple(v) if isinstance(v, list) else v for v in fields[key])
    ticket = wire.Ticket(**fields, state_position=fields["num_tokens"])
    if signed:
        try:
            ticket = claims.sign(ticket, None)  # the digest anyone can compute without a secret
        except Exception:  # noqa: BLE001 - a field msgspec cannot encode: the ticket stays unsigned
            pass
    return ticket


@settings(max_examples=PARAMS_EXAMPLES, deadline=None)
@given(data=st.data())
def test_ticket_from_params_gives_a_ticket_or_a_typed_error(data):
    silent = ["tcp://127.0.0.1:5600", "tcp://127.0.0.1:5601"]
    ticket = _ticket(data.draw(_fields(silent)))
    try:
        params = ticket_to_params(ticket)
    except Exception:  # noqa: BLE001 - a hostile field ticket_to_params cannot write: fuzz the dict directly
        params = {f: getattr(ticket, f) for f in wire.Ticket.__struct_fields__}
    for key in data.draw(st.lists(st.sampled_from(list(params) + ["extra"]), max_size=2)):
        params[key] = data.draw(hostile_values)
    try:
        decoded = ticket_from_params(params)
    except TicketParamsError as exc:
        assert len(str(exc)) < 1000 and isinstance(exc.field, str)
    else:
        assert isinstance(decoded, wire.Ticket) and ticket_to_params(decoded) == params


LOCALS = [[[1, 2], [3], [4], [5]], [[1, 2], [3], [4], [5]], [[1], [3], [4], [5]], [[1, True], [3], [4], [5]],
          [[1, 2], [3], [4], [99]], [[1, 2], [3], [4]], "1234", [[-1, 2], [3], [4], [5]], [[2**100000, 2], [3], [4], [5]]]


def test_start_read_and_decline_on_one_long_lived_consumer(fuzzed, silent):
    consumer, clock = fuzzed
    # Warm up: the first socket starts ZeroMQ's I/O thread and NIXL's lazily opened descriptors stay open.
    consumer.start_read(_ticket({"engine_id": "warm", "incarnation": 1, "addresses": [silent[0]], "tp_size": 1,
                                 "request_id": "warm", "nonce": 1, "block_ids": [[6, 7], [8], [9], [10]],
                                 "num_tokens": 20, "lease_s": 60.0, "version": wire.PROTOCOL_VERSION,
                                 "signed": True}), LOCALS[0])
    _drain(consumer, clock, 100.0)
    _drain(consumer, clock, 100.0)
    time.sleep(0.2)  # the warm-up socket's descriptors close on ZeroMQ's own thread
    start = (_fds(), consumer.num_links, consumer.num_handshake_sockets, consumer.num_active)
    outcomes: dict[str, int] = {}

    @settings(max_examples=READ_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(fields=_fields(silent), local=st.sampled_from(LOCALS), decline=st.booleans())
    def one(fields, local, decline):
        ticket = _ticket(fields)
        try:
            if decline:
                consumer.decline(ticket)
            else:
                consumer.start_read(ticket, local)
            outcome = "declined" if decline else "started"
        except HybridTransferError as exc:
            assert len(str(exc)) < 2000, type(exc)
            outcome = type(exc).__name__
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        assert consumer.num_handshake_sockets <= 4 and consumer.num_links <= 4
        _drain(consumer, clock, 2 * TIMEOUT_S + 0.1)  # every handshake and read deadline of this example passes

    one()
    _drain(consumer, clock, 100.0)  # every backoff, and the 30 s after it, is over: failed links are forgotten
    deadline = time.monotonic() + 10.0  # ZeroMQ closes a socket's descriptors on its own thread, a moment later
    while _fds() > start[0] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _fds() <= start[0], outcomes
    assert (consumer.num_links, consumer.num_handshake_sockets, consumer.num_active) == start[1:], outcomes
    assert outcomes.get("started", 0) > 0 and len(outcomes) > 3, outcomes  # the draws reached both sides
