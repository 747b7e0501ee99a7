"""Bind address and advertised address (issue 14, row 7): a wildcard bind never ends up in a ticket."""

from __future__ import annotations

import pytest
import zmq
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import EngineConfig, Producer, handshake, wire
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.plan.rank import describe_rank

MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
WAIT_MS = 20_000


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "[::]", "*"])
def test_a_wildcard_bind_needs_an_advertised_host(host):
    with pytest.raises(ConfigError) as info:
        EngineConfig(side_channel_host=host).validate()
    assert info.value.field == "advertise_host" and host in str(info.value)
    assert EngineConfig(side_channel_host=host, advertise_host="10.1.2.3").validate().advertise_host == "10.1.2.3"


@pytest.mark.parametrize("advertised", ["0.0.0.0", "*", "::", "", "tcp://10.0.0.1", 5])
def test_the_advertised_host_must_be_one_other_hosts_can_reach(advertised):
    with pytest.raises(ConfigError) as info:
        EngineConfig(side_channel_host="0.0.0.0", advertise_host=advertised).validate()
    assert info.value.field == "advertise_host"


def test_a_producer_bound_to_a_wildcard_without_an_advertised_host_is_refused_before_binding():
    with pytest.raises(ConfigError, match="advertise_host"):
        Producer(HybridCache.allocate(GEOMETRY, 8), EngineConfig(side_channel_host="0.0.0.0"))


def _handshake(address: str) -> wire.HandshakeReply:
    request = handshake.make_request(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 8),
                                     "consumer", "d")
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IPV6, 1)
        sock.connect(address)
        sock.send(request)
        assert sock.poll(WAIT_MS), f"no answer at {address}"
        return wire.decode(sock.recv())[1]
    finally:
        ctx.destroy(linger=0)


@pytest.mark.parametrize(("bind", "advertised", "expected_host"), [
    ("0.0.0.0", "127.0.0.1", "127.0.0.1"),
    ("*", "localhost", "localhost"),
    ("::", "::1", "[::1]"),
])
def test_tickets_and_handshake_replies_advertise_the_advertised_host(bind, advertised, expected_host):
    config = EngineConfig(side_channel_host=bind, advertise_host=advertised)
    with Producer(HybridCache.allocate(GEOMETRY, 8), config) as producer:
        host, _, port = producer.address.removeprefix("tcp://").rpartition(":")
        assert host == expected_host and int(port) > 0
        ticket = producer.hold("r", [[1], [2], [3], [4]], 4)
        assert ticket.addresses == (producer.address,)
        reply = _handshake(producer.address)  # the advertised address reaches the wildcard listener
        assert reply.accepted and reply.engine_addresses == (producer.address,)


def test_without_an_advertised_host_the_bind_host_is_advertised():
    with Producer(HybridCache.allocate(GEOMETRY, 8)) as producer:
        assert producer.address.startswith("tcp://127.0.0.1:")
