"""The handshake listener over real ZeroMQ: hostile peers get typed errors, others keep being served."""

from __future__ import annotations

import pytest
import zmq
from harness import TINY

from hybrid_transfer.engine import handshake, wire
from hybrid_transfer.engine.handshake import ListenerStats, ProducerCard
from hybrid_transfer.engine.side_channel import HandshakeClient, HandshakeServer
from hybrid_transfer.layout import RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.plan.rank import describe_rank

MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
TIMEOUT_MS = 5000


@pytest.fixture
def served():
    card = ProducerCard(MODEL, fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 20, 1 << 24], 8), "p0",
                        b"metadata", "prefill", 3, ("tcp://127.0.0.1:1",))
    stats, accepted = ListenerStats(), []

    def respond(data: bytes) -> bytes:
        return handshake.answer(card, data, stats, accepted.append)

    server = HandshakeServer("127.0.0.1", 0, respond, name="test-handshake-listener")
    server.start()
    ctx = zmq.Context()
    yield server, card, stats, accepted, ctx
    ctx.destroy(linger=0)
    server.close()


def _request(name: str) -> bytes:
    return handshake.make_request(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 8), name, "d")


def _ask(ctx, address: str, frames: list[bytes], kind=zmq.DEALER) -> bytes:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    sock.send_multipart(frames)
    assert sock.poll(TIMEOUT_MS), "the listener did not answer"
    reply = sock.recv_multipart()[-1]
    sock.close()
    return reply


@pytest.mark.parametrize("frames", [
    [b"garbage"], [b""], [_request("x")[:7]], [b"\x93", b"two frames"], [b"\x00" * 70000],
], ids=["garbage", "empty", "truncated", "multi-frame", "long"])
def test_hostile_messages_get_a_typed_error_and_the_listener_keeps_serving(served, frames):
    server, card, stats, accepted, ctx = served
    _, body = wire.decode(_ask(ctx, server.address, frames))
    assert isinstance(body, wire.ErrorReply) and body.reason
    assert stats.garbage == 1
    # Another peer is served normally afterwards.
    assert _ask(ctx, server.address, [_request("good")]) == card.accepted_reply
    assert accepted == ["good"] and server.is_alive


def test_a_req_socket_peer_is_answered_too(served):
    server, card, _, accepted, ctx = served
    assert _ask(ctx, server.address, [_request("req-peer")], kind=zmq.REQ) == card.accepted_reply
    assert accepted == ["req-peer"]


def test_many_peers_through_the_client(served):
    server, card, stats, _, _ = served
    client = HandshakeClient()
    try:
        client.send(server.address, b"junk")
        client.send(server.address, _request("c1"))
        replies = []
        while len(replies) < 2:
            got = client.receive(TIMEOUT_MS)
            assert got, "no reply"
            replies += got
        assert {a for a, _ in replies} == {server.address}
        assert [r for _, r in replies].count(card.accepted_reply) == 1
        assert stats.garbage == 1 and stats.accepted == 1
    finally:
        client.close()


def test_a_responder_bug_does_not_kill_the_listener():
    calls = []

    def respond(data: bytes) -> bytes:
        calls.append(data)
        if data == b"boom":
            raise RuntimeError("bug")
        return b"fine"

    server = HandshakeServer("127.0.0.1", 0, respond, name="test-buggy-listener")
    server.start()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(server.address)
        sock.send(b"boom")
        sock.send(b"ok")
        assert sock.poll(TIMEOUT_MS) and sock.recv() == b"fine"
        assert server.is_alive and server.num_dropped == 1 and calls == [b"boom", b"ok"]
        sock.close()
    finally:
        ctx.destroy(linger=0)
        server.close()
        server.close()  # idempotent
    assert not server.is_alive
