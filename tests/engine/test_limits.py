"""Bounded resources against a hostile neighbour (issue 14, row 4): frame size, pending handshakes, name lengths."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import EngineConfig, Producer, handshake, wire
from hybrid_transfer.engine.side_channel import HandshakeClient, HandshakeServer
from hybrid_transfer.errors import WireDecodeError
from hybrid_transfer.layout import RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.plan.rank import describe_rank

MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
WAIT_S = 20.0


def _request(name: str, engine_id: str = "d") -> bytes:
    return handshake.make_request(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 8), name,
                                  engine_id)


# ---- frames larger than MAX_MESSAGE_BYTES never reach the responder -----------------------------------------


def test_an_oversized_frame_is_cut_off_by_zeromq_and_never_buffered_for_the_responder():
    seen: list[int] = []

    def respond(data: bytes) -> bytes:
        seen.append(len(data))
        return b"ok"

    server = HandshakeServer("127.0.0.1", 0, respond, name="test-limits-listener")
    server.start()
    ctx = zmq.Context()
    try:
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        monitor = big.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        big.connect(server.address)
        big.send(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))
        # Either the listener answers the frame (it was read whole) or ZeroMQ drops the connection at the
        # frame header: wait for whichever comes first.
        poller = zmq.Poller()
        poller.register(big, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        events = dict(poller.poll(int(WAIT_S * 1000)))
        assert big not in events, f"the listener read and answered a {wire.MAX_MESSAGE_BYTES + 1} B frame"
        assert monitor in events, "neither an answer nor a disconnect"
        # Another peer is still served, and the responder never saw the big frame.
        good = ctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        good.connect(server.address)
        good.send(b"hello")
        assert good.poll(int(WAIT_S * 1000)) and good.recv() == b"ok"
        assert seen == [5]
        big.disable_monitor()
        monitor.close(0)
    finally:
        ctx.destroy(linger=0)
        server.close()


def _listener(**kw) -> tuple[HandshakeServer, list[int]]:
    seen: list[int] = []

    def respond(data: bytes) -> bytes:
        seen.append(len(data))
        return b"ok"

    server = HandshakeServer("127.0.0.1", 0, respond, name="test-limits-listener", **kw)
    server.start()
    return server, seen


def _send_then_hello(address: str, frames: list[bytes]) -> bool:
    """Send one multipart message, then a one-frame b"hello" on another socket; whether the first was answered."""
    ctx = zmq.Context()
    try:
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.connect(address)
        big.send_multipart(frames)
        good = ctx.socket(zmq.DEALER)
        good.setsockopt(zmq.LINGER, 0)
        good.connect(address)
        good.send(b"hello")
        assert good.poll(int(WAIT_S * 1000)) and good.recv() == b"ok", "no answer to the honest peer"
        return bool(big.poll(200))
    finally:
        ctx.destroy(linger=0)


def _until(condition) -> bool:
    deadline = time.monotonic() + WAIT_S
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_message_over_the_cap_in_total_across_frames_never_reaches_the_responder():
    """Row 7, lowered caps: 64 frames of 64 KiB (each under the per-frame cap) against a 1 MiB total."""
    server, seen = _listener(max_message_bytes=1 << 20)
    try:
        assert not _send_then_hello(server.address, [b"\x00" * (64 << 10)] * 64)
        assert _until(lambda: server.num_oversized == 1) and seen == [5]
        _send_then_hello(server.address, [b"\x00" * (64 << 10)] * 2)  # 2 frames, 128 KiB: under the cap
        assert _until(lambda: len(seen) == 3) and sorted(seen) == [5, 5, 128 << 10] and server.num_oversized == 1
    finally:
        server.close()


def test_the_default_total_cap_is_the_one_message_cap():
    """Frames of 512 KiB, each far under MAX_MESSAGE_BYTES per frame, but twice it in total: dropped, counted."""
    server, seen = _listener()
    try:
        count = 2 * wire.MAX_MESSAGE_BYTES // (512 << 10)
        assert not _send_then_hello(server.address, [b"\x00" * (512 << 10)] * count)
        assert _until(lambda: server.num_oversized == 1) and seen == [5]
        assert not _send_then_hello(server.address, [b"a", b"b", b"c", b"d"])  # small, but not ours: 5 frames
        assert _until(lambda: server.num_oversized == 2) and seen == [5, 5]
    finally:
        server.close()


def test_the_consumer_side_sockets_refuse_oversized_frames_too():
    client = HandshakeClient()
    try:
        client.send("tcp://127.0.0.1:1", b"x")  # nobody listens; the socket exists with its options
        sock = client._socks["tcp://127.0.0.1:1"]
        assert sock.getsockopt(zmq.MAXMSGSIZE) == wire.MAX_MESSAGE_BYTES
    finally:
        client.close()


# ---- length caps on names and string fields, checked while decoding --------------------------------------


def _digest() -> str:
    return fingerprint_of(GEOMETRY).digest()


@pytest.mark.parametrize("body", [
    lambda: wire.HandshakeRequest(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 8),
                                  "a" * 8192, "d"),
    lambda: wire.HandshakeRequest(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 8),
                                  "agent", "e" * (wire.MAX_NAME_CHARS + 1)),
    lambda: wire.HandshakeReply(accepted=True, agent_name="n" * (wire.MAX_NAME_CHARS + 1)),
    lambda: wire.HandshakeReply(accepted=True, engine_addresses=("tcp://" + "h" * wire.MAX_ADDRESS_CHARS,)),
    lambda: wire.Completion("r" * (wire.MAX_REQUEST_ID_CHARS + 1), 1, 0, 1),
    lambda: wire.Heartbeat(0, (wire.RequestRef("r" * (wire.MAX_REQUEST_ID_CHARS + 1), 1),)),
    lambda: wire.Staged("r" * (wire.MAX_REQUEST_ID_CHARS + 1), 1, wire.StagingStatus.ABSENT),
    lambda: wire.ErrorReply("x" * (wire.MAX_TEXT_CHARS + 1)),
], ids=["agent-name", "engine-id", "reply-agent-name", "address", "completion-request-id", "heartbeat-request-id",
        "staging-request-id", "error-reason"])
def test_an_overlong_string_field_fails_to_decode(body):
    with pytest.raises(WireDecodeError, match="length"):
        wire.decode(wire.encode(body(), _digest()))


def test_names_at_the_cap_still_decode():
    request = wire.HandshakeRequest(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 8),
                                    "a" * wire.MAX_NAME_CHARS, "e" * wire.MAX_NAME_CHARS)
    assert wire.decode(wire.encode(request, _digest()))[1] == request
    completion = wire.Completion("r" * wire.MAX_REQUEST_ID_CHARS, 1, 0, 1)
    assert wire.decode(wire.encode(completion, _digest()))[1] == completion


def test_a_ticket_with_an_overlong_request_id_fails_to_decode():
    ticket = wire.Ticket("e", 1, ("tcp://127.0.0.1:1",), 1, "r" * (wire.MAX_REQUEST_ID_CHARS + 1), 1,
                         ((1,),), 1, 1, 10.0)
    with pytest.raises(WireDecodeError, match="request_id"):
        wire.decode_ticket(wire.encode_ticket(ticket))


def test_the_listener_refuses_a_handshake_with_an_8_kib_agent_name():
    card = handshake.ProducerCard(MODEL, fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 20, 1 << 24], 8),
                                  "p0", b"metadata", "prefill", 3, ("tcp://127.0.0.1:1",))
    stats, accepted = handshake.ListenerStats(), []
    _, reply = wire.decode(handshake.answer(card, _request("a" * 8192), stats, accepted.append))
    assert isinstance(reply, wire.ErrorReply) and "length" in reply.reason
    assert accepted == [] and stats.garbage == 1


# ---- pending handshakes: capped, and evicted after a deadline on the producer's clock ----------------------


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _ask_all(address: str, payloads: list[bytes]) -> list[bytes]:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        replies = []
        for payload in payloads:  # one at a time: the listener answers in order
            sock.send(payload)
            assert sock.poll(int(WAIT_S * 1000)), "the listener did not answer"
            replies.append(sock.recv())
        return replies
    finally:
        ctx.destroy(linger=0)


def test_handshakes_never_followed_by_a_hello_are_capped_and_then_expire():
    clock = _Clock()
    config = EngineConfig(max_pending_handshakes=4, pending_handshake_s=30.0)
    producer = Producer(HybridCache.allocate(GEOMETRY, 8), config, clock=clock)
    try:
        replies = _ask_all(producer.address, [_request(f"ghost-{i}") for i in range(10)])
        assert all(isinstance(wire.decode(r)[1], wire.HandshakeReply) for r in replies)
        producer.poll()
        assert producer.num_pending_handshakes == 4  # the newest four; the six oldest were evicted
        assert producer.stats.handshakes_evicted == 6 and producer.stats.handshakes_expired == 0
        clock.now += 29.0
        producer.poll()
        assert producer.num_pending_handshakes == 4
        clock.now += 2.0
        producer.poll()
        assert producer.num_pending_handshakes == 0 and producer.stats.handshakes_expired == 4
        # The table takes new handshakes afterwards.
        _ask_all(producer.address, [_request("late")])
        producer.poll()
        assert producer.num_pending_handshakes == 1
    finally:
        producer.close()


@pytest.mark.parametrize(("field", "value"), [("max_pending_handshakes", 0), ("pending_handshake_s", 0.0),
                                              ("max_pending_handshakes", True)])
def test_pending_handshake_limits_are_validated(field, value):
    from hybrid_transfer.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        EngineConfig(**{field: value}).validate()
    assert info.value.field == field


def test_the_limits_are_config_fields_with_defaults():
    config = msgspec.convert({}, EngineConfig)
    assert config.max_pending_handshakes > 0 and config.pending_handshake_s > 0


# ---- error messages echo at most ECHO_CHARS of a value, and are bounded whole (issue 19, row 7) -------------


def test_a_huge_field_is_cut_in_the_error_message_at_one_constant():
    from hybrid_transfer import errors
    from hybrid_transfer.errors import ConfigError, PlanError, TicketClaimError

    huge = "h" * 10_000_000  # the 10 MB field
    with pytest.raises(ConfigError) as info:
        EngineConfig(mode=huge).validate()
    message = str(info.value)
    assert len(message) < 10_000 and "mode" in message  # not the 10 MB the value has
    assert len(message) <= errors.MESSAGE_CHARS + 100
    assert info.value.value == huge  # the attribute keeps the value whole
    claim = TicketClaimError(request_id=huge, nonce=1, agent="a", status="ENDED")
    assert errors.echo(huge) == repr(huge)[: errors.ECHO_CHARS] + f"... ({len(huge) + 2} chars)"
    assert errors.echo(huge) in str(claim)
    assert len(str(claim)) < 2 * errors.ECHO_CHARS + 200
    assert len(str(PlanError(huge))) <= errors.MESSAGE_CHARS + 100  # any message, however it was built
    assert errors.echo(list(range(100_000))).endswith("... (100000 items)")
    assert errors.echo("short") == "'short'"


def test_every_typed_error_built_from_a_huge_message_is_bounded():
    import inspect

    from hybrid_transfer import errors

    huge = "m" * 1_000_000
    assert len(str(errors.PlanError(huge))) < 10_000
    checked = 0
    for cls in vars(errors).values():
        if not (inspect.isclass(cls) and issubclass(cls, errors.HybridTransferError)):
            continue
        try:
            error = cls(huge)
        except (TypeError, ValueError):  # other signatures: their messages echo through errors.echo
            continue
        assert len(str(error)) <= errors.MESSAGE_CHARS + 100, cls.__name__
        checked += 1
    assert checked >= 5


def test_a_ticket_field_is_echoed_cut():
    from hybrid_transfer import errors

    ticket = wire.Ticket(engine_id="e", incarnation=1, addresses=("tcp://h:1",), tp_size=1, request_id="r",
                         nonce=1, block_ids=((1,),), num_tokens=-1, state_position=0, lease_s=1.0,
                         mac=b"")
    bad = msgspec.structs.replace(ticket, block_ids=(tuple(range(1_000_000)),), num_tokens=-1)
    with pytest.raises(WireDecodeError) as info:
        wire.check_ticket(bad)
    assert "num_tokens" in str(info.value) and len(str(info.value)) <= errors.MESSAGE_CHARS + 100
    with pytest.raises(errors.HandshakeError) as info:  # a refusal's text comes from the peer
        handshake.read_reply(wire.encode(wire.HandshakeReply(accepted=False, error="x" * wire.MAX_TEXT_CHARS,
                                                             differences=(wire.FieldDifference("f", "y" * 10_000,
                                                                                               "z"),)), ""),
                             address="tcp://h:1", digest="")
    assert len(str(info.value)) < 10_000
