"""doctor/link_wire.py: bounded frames, deadlines, and proofs of the secret bound to one exchange."""

from __future__ import annotations

import os
import socket
import struct
import time

import pytest

from hybrid_transfer.doctor import link_wire as w
from hybrid_transfer.errors import ConfigError, EngineError

SECRET = b"s" * 32


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_a_message_round_trips(pair):
    a, b = pair
    sent = w.Hello(version=w.LINK_VERSION, server_agent="srv", sn=b"n" * 32, secret_required=True, num_bytes=4096)
    w.send(a, sent)
    assert w.recv(b, time.monotonic() + 5, "Hello", "me") == sent


def test_an_oversized_frame_is_refused_before_it_is_read(pair):
    a, b = pair
    a.sendall(struct.pack(">I", w.MAX_FRAME_BYTES + 1))
    with pytest.raises(EngineError, match=f"a frame of {w.MAX_FRAME_BYTES + 1} bytes"):
        w.recv(b, time.monotonic() + 5, "Hello", "me")


def test_bytes_that_are_no_message_and_a_silent_peer_fail_typed(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 3) + b"\xc1\xc1\xc1")
    with pytest.raises(EngineError, match="not a doctor message"):
        w.recv(b, time.monotonic() + 5, "Hello", "me")
    with pytest.raises(EngineError, match="did not arrive before the deadline"):
        w.recv(b, time.monotonic() + 0.05, "Join", "me")
    a.close()
    with pytest.raises(EngineError, match="closed the connection"):
        w.recv(b, time.monotonic() + 5, "Join", "me")


def test_a_proof_holds_only_for_its_role_nonces_agents_and_secret():
    args = (b"c" * 32, b"s" * 32, "srv", "peer")
    shown = w.prove(SECRET, w.PEER_ROLE, *args)
    assert w.proven(SECRET, w.PEER_ROLE, shown, *args)
    assert not w.proven(SECRET, w.SERVE_ROLE, shown, *args)  # a reflected proof
    assert not w.proven(SECRET, w.PEER_ROLE, shown, b"x" * 32, *args[1:])  # another exchange
    assert not w.proven(b"t" * 32, w.PEER_ROLE, shown, *args)
    assert not w.proven(SECRET, w.PEER_ROLE, b"", *args)
    assert w.prove(None, w.PEER_ROLE, *args) == b""


def test_peer_addresses():
    assert w.parse_peer_address("10.1.2.3:5599") == ("10.1.2.3", 5599)
    assert w.parse_peer_address("tcp://[::1]:7") == ("::1", 7)
    with pytest.raises(ConfigError, match="'h:0'"):
        w.parse_peer_address("h:0")


def test_a_peer_refuses_a_server_that_asks_it_to_pin_too_much_before_loading_nixl(monkeypatch):
    """A hostile or broken server's size is checked before the peer makes an agent or pins a byte."""
    monkeypatch.delenv("UCX_LOG_FILE", raising=False)
    monkeypatch.delenv("UCX_PROTO_INFO", raising=False)
    import sys
    import threading

    from hybrid_transfer.doctor.link import MAX_LINK_BYTES, LinkOptions, peer

    listener = socket.create_server(("127.0.0.1", 0))
    hello = w.Hello(version=w.LINK_VERSION, server_agent="srv", sn=b"n" * 32, secret_required=False,
                    num_bytes=MAX_LINK_BYTES * 2)

    def serve_once():
        conn, _ = listener.accept()
        with conn:
            w.send(conn, hello)
            conn.recv(1)  # until the peer hangs up

    server = threading.Thread(target=serve_once, daemon=True)
    server.start()
    loaded = "nixl" in sys.modules
    report = peer(LinkOptions(host="127.0.0.1", port=listener.getsockname()[1], timeout_s=10))
    server.join(10)
    listener.close()
    (link,) = report.checks
    assert link.name == "peer_link" and link.status.value == "fail"
    assert f"num_bytes={MAX_LINK_BYTES * 2}" in link.detail
    assert ("nixl" in sys.modules) == loaded  # no agent was made
    assert "UCX_LOG_FILE" not in os.environ and "UCX_PROTO_INFO" not in os.environ  # restored
