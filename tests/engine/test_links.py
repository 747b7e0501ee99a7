"""A consumer's links to producer engines (engine/peers.py): where it may connect, what a ticket cannot poison,
how a failed link heals, and the bounds on links and handshake sockets (issue 19 rows 2, 4 and 5).

Producers and consumers here are real (NIXL agents with the UCX backend, ZeroMQ on loopback) in this one
process, polled in turn; refusing and silent "producers" are real ZeroMQ sockets with canned answers. The
consumer's clock is injected wherever a deadline or a backoff matters; wall time only bounds the waits.
"""

from __future__ import annotations

import secrets
import time

import msgspec
import pytest
import zmq
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, Producer, ReadState, auth, claims, wire
from hybrid_transfer.engine.lifecycle.state import FailureCause
from hybrid_transfer.engine.side_channel import HandshakeClient, HandshakeServer
from hybrid_transfer.errors import HandshakeError, TicketError
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.verify import RequestLayout, check_destination_many, fill_source, poison

MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
LAYOUT = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
LOCAL = RequestLayout(((5, 6), (7,), (8,), (9,)), 20)
OTHER_LOCAL = RequestLayout(((10, 11), (12,), (13,), (14,)), 20)
WAIT_S = 20.0  # a bound on waits for real sockets and agents, never an assertion
SECRET = b"links-secret-for-tests-0123456789"


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def no_secret_in_the_environment(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)


def _consumer(config: EngineConfig | None = None, clock=time.monotonic) -> Consumer:
    cache = HybridCache.allocate(GEOMETRY, 16)
    poison(cache)
    return Consumer(cache, config or EngineConfig(), clock=clock)


def _producer(config: EngineConfig | None = None, **kwargs) -> Producer:
    return Producer(HybridCache.allocate(GEOMETRY, 16), config or EngineConfig(), **kwargs)


def _wait(consumer: Consumer, producers, request_id: str):
    """Poll the consumer and the producers until ``request_id`` is reported."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for result in consumer.poll():
            if result.request_id == request_id:
                return result
        for producer in producers:
            producer.poll()
        time.sleep(0.001)
    raise AssertionError(f"{request_id} was not reported within {WAIT_S} s")


def _settle(consumer: Consumer, producers, seconds: float = 0.3) -> None:
    """Keep polling for a while: replies that may still be on their way are taken in (nothing is asserted on it)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        consumer.poll()
        for producer in producers:
            producer.poll()
        time.sleep(0.002)


def _read(consumer: Consumer, producers, ticket: wire.Ticket, local: RequestLayout, seed: int, earlier=()):
    """Read ``ticket`` into ``local``: DONE, and the cache holds its bytes (and those of ``earlier`` reads) only."""
    consumer.start_read(ticket, local.block_ids)
    result = _wait(consumer, producers, ticket.request_id)
    assert result.state is ReadState.DONE, result.error
    check_destination_many(consumer.cache, [*earlier, (local, seed)])
    return result


def _ticket(address: str, request_id: str = "r", engine_id: str = "pa", incarnation: int = 7) -> wire.Ticket:
    return claims.sign(wire.Ticket(engine_id=engine_id, incarnation=incarnation, addresses=(address,), tp_size=1,
                                   request_id=request_id, nonce=secrets.randbits(63), block_ids=LAYOUT.block_ids,
                                   num_tokens=20, state_position=20, lease_s=60.0), None)


def _listened(producer: Producer) -> int:
    """Handshake requests a producer's listener has answered in any way."""
    stats = producer.listener_stats
    return stats.accepted + stats.rejected + stats.garbage


@pytest.fixture
def silent():
    """A ROUTER bound to six loopback ports that never answers: handshakes to them wait for their deadline."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    addresses = [f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}" for _ in range(6)]
    yield addresses
    ctx.destroy(linger=0)


class Refuser:
    """A side-channel listener that refuses every handshake with ``cause``, as a version 7 producer does (None:
    naming no cause, as an older producer did)."""

    def __init__(self, cause: str | None, engine_key=("pa", 7)):
        self.asked = 0
        named = {} if cause is None else {"cause": cause}
        reply = wire.encode(wire.HandshakeReply(accepted=False, error=f"refused ({cause})", engine_id=engine_key[0],
                                                incarnation=engine_key[1], **named), "")

        def respond(data: bytes) -> bytes:
            self.asked += 1
            return reply

        self.server = HandshakeServer("127.0.0.1", 0, respond, name="test-refuser")
        self.address = self.server.address
        self.port = int(self.address.rsplit(":", 1)[1])
        self.server.start()

    def close(self) -> None:
        self.server.close()


# ---- row 5: a ticket cannot poison the link of the engine it names --------------------------------------------
@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
def test_a_ticket_naming_one_engine_with_another_engines_address_does_not_poison_its_link(with_secret, tmp_path):
    """Row 5: a ticket with A's engine id and B's address (a garbage MAC with a secret, the digest anyone computes
    without), then A's real ticket: it reads DONE with the right bytes."""
    if with_secret:
        path = tmp_path / "secret"
        path.write_bytes(SECRET)
        config = EngineConfig(secret_file=str(path))
    else:
        config = EngineConfig()
    with _producer(config, engine_id="pa") as a, _producer(config, engine_id="pb") as b, _consumer(config) as c:
        fill_source(a.cache, LAYOUT, 11)
        real = a.hold("r", LAYOUT.block_ids, 20)
        hostile = msgspec.structs.replace(real, request_id="hostile", addresses=(b.address,))
        hostile = msgspec.structs.replace(hostile, mac=secrets.token_bytes(32)) if with_secret else claims.sign(
            hostile, None)
        c.start_read(hostile, OTHER_LOCAL.block_ids)
        result = _wait(c, [a, b], "hostile")
        assert result.state is ReadState.FAILED
        if with_secret:  # the MAC is checked before any connect: B never heard of this consumer
            assert result.cause is FailureCause.TICKET_EDITED
            _settle(c, [a, b])
            assert _listened(b) == 0
        else:  # B answered as itself: the ticket's requests fail, nothing is stored under A's key
            assert result.cause is FailureCause.HANDSHAKE and _listened(b) == 1
        _read(c, [a, b], real, LOCAL, 11)
        assert c.num_links == 1 and _wait_freed(a, "r")
        if not with_secret:
            assert result.error.cause == "mismatch"


def _wait_freed(producer: Producer, request_id: str) -> bool:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if request_id in producer.poll():
            return True
    return False


def test_a_ticket_whose_addresses_differ_from_a_ready_link_fails_alone():
    with _producer(engine_id="pa") as a, _producer(engine_id="pb") as b, _consumer() as c:
        fill_source(a.cache, LAYOUT, 3)
        _read(c, [a, b], a.hold("r1", LAYOUT.block_ids, 20), LOCAL, 3)
        second = a.hold("r2", LAYOUT.block_ids, 20)
        moved = claims.sign(msgspec.structs.replace(second, addresses=(b.address,)), None)
        with pytest.raises(TicketError) as info:
            c.start_read(moved, OTHER_LOCAL.block_ids)
        assert info.value.field == "addresses" and b.address in str(info.value) and a.address in str(info.value)
        assert not c.is_active("r2") and _listened(b) == 0
        _read(c, [a, b], second, OTHER_LOCAL, 3, [(LOCAL, 3)])  # the link to A is untouched


# ---- allowed_producers -------------------------------------------------------------------------------------
def test_a_producer_not_allowed_is_never_connected_and_a_port_range_allows_one():
    with _producer(engine_id="pa") as a:
        port = int(a.address.rsplit(":", 1)[1])
        with _consumer(EngineConfig(allowed_producers=("10.0.0.0/8", f"127.0.0.1:{port + 1}-{port + 9}"))) as c:
            fill_source(a.cache, LAYOUT, 4)
            ticket = a.hold("r", LAYOUT.block_ids, 20)
            with pytest.raises(TicketError) as info:
                c.start_read(ticket, LOCAL.block_ids)
            assert type(info.value).__name__ == "ProducerNotAllowedError" and a.address in str(info.value)
            with pytest.raises(TicketError, match="allowed_producers"):
                c.decline(ticket)
            with pytest.raises(HandshakeError) as refused:
                c.connect(a.address, timeout_s=1.0)
            assert refused.value.cause == "disallowed"
            assert not c.is_active("r") and c.num_links == 0 and c.num_handshake_sockets == 0 and _listened(a) == 0
        with _consumer(EngineConfig(allowed_producers=(f"127.0.0.1:{port}",))) as c:
            _read(c, [a], ticket, LOCAL, 4)


def test_allowed_producers_entries_are_checked_at_start():
    for bad in [(), ("10.0.0.0/33",), ("host:0",), ("host:9-3",), ("[::1",), ("a b",)]:
        with pytest.raises(Exception) as info:
            EngineConfig(allowed_producers=bad).validate()
        assert type(info.value).__name__ == "ConfigError" and info.value.field == "allowed_producers", bad
    config = EngineConfig.from_dict({"allowed_producers": ["10.1.2.0/24:5600-5700", "prefill.example:5600",
                                                           "[fd00::/8]:5600", "::1"]})
    assert config.allowed_producers[0] == "10.1.2.0/24:5600-5700"


# ---- decline checks the MAC before it connects ------------------------------------------------------------
def test_decline_checks_the_mac_before_it_connects_anywhere(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    config = EngineConfig(secret_file=str(path))
    with _producer(config, engine_id="pa") as a, _consumer(config) as c:
        ticket = a.hold("r", LAYOUT.block_ids, 20)
        forged = msgspec.structs.replace(ticket, mac=secrets.token_bytes(32))
        with pytest.raises(TicketError) as info:
            c.decline(forged)
        assert info.value.field == "mac"
        with pytest.raises(TicketError):
            c.decline(msgspec.structs.replace(ticket, mac=b""))  # unsigned: refused where a secret is set
        _settle(c, [a], 0.1)
        assert _listened(a) == 0 and c.num_links == 0 and c.num_handshake_sockets == 0 and a.is_held("r")
        assert c.decline(ticket)  # the real one: the producer frees at once, not at lease expiry
        deadline = time.monotonic() + WAIT_S
        freed: list[str] = []
        while not freed and time.monotonic() < deadline:
            c.poll()
            freed = a.poll()
        assert freed == ["r"] and c.stats.declines_sent == 1


# ---- links heal (row 4, consumer half) -------------------------------------------------------------------
def test_a_refused_link_heals_after_its_backoff():
    """Row 4: a refusal used to keep the failed link for good, so every later ticket of that producer failed."""
    clock = FakeClock()
    refuser = Refuser(None)
    port = refuser.port
    with _consumer(EngineConfig(handshake_timeout_s=5.0), clock=clock) as c:
        c.start_read(_ticket(refuser.address, "r0"), LOCAL.block_ids)
        first = _wait(c, [], "r0")
        assert first.state is ReadState.FAILED and first.cause is FailureCause.HANDSHAKE
        refuser.close()
        with pytest.raises(HandshakeError):  # during the backoff
            c.start_read(_ticket(f"tcp://127.0.0.1:{port}", "early"), LOCAL.block_ids)
        with _producer(EngineConfig(side_channel_port=port), engine_id="pa", incarnation=7) as a:
            fill_source(a.cache, LAYOUT, 6)
            real = a.hold("r1", LAYOUT.block_ids, 20)
            clock.now += 0.5  # the first backoff
            _read(c, [a], real, LOCAL, 6)
        assert (c.link_stats.failures, c.link_stats.retries) == (1, 1)


def test_a_ticket_during_the_backoff_fails_at_once_naming_the_producers_cause_and_the_backoff_doubles():
    clock = FakeClock()
    refuser = Refuser("capacity")
    try:
        with _consumer(EngineConfig(handshake_timeout_s=5.0), clock=clock) as c:
            c.start_read(_ticket(refuser.address, "r0"), LOCAL.block_ids)
            result = _wait(c, [], "r0")
            assert result.error.cause == "capacity" and isinstance(result.error, HandshakeError)
            waits = []
            for i, backoff in enumerate((0.5, 1.0, 2.0, 4.0)):
                with pytest.raises(HandshakeError) as info:  # during the backoff: at once, nothing sent
                    c.start_read(_ticket(refuser.address, f"early{i}"), LOCAL.block_ids)
                assert info.value.cause == "capacity" and f"next handshake in {backoff:.1f} s" in str(info.value)
                asked = refuser.asked
                clock.now += backoff
                c.start_read(_ticket(refuser.address, f"r{i + 1}"), LOCAL.block_ids)
                assert _wait(c, [], f"r{i + 1}").error.cause == "capacity"
                waits.append(refuser.asked - asked)
            assert waits == [1, 1, 1, 1] and c.link_stats.retries == 4 and c.link_stats.failures == 5
            assert c.num_handshake_sockets == 0
            clock.now += 16.0 + 30.0  # nobody asked for 30 s after the retry time: the failed link is forgotten
            c.poll()
            assert c.num_links == 0 and c.link_stats.expired == 1
    finally:
        refuser.close()


def test_a_timed_out_link_names_timeout_and_a_malformed_or_unreachable_address_is_typed(silent):
    clock = FakeClock()
    with _consumer(EngineConfig(handshake_timeout_s=2.0), clock=clock) as c:
        c.start_read(_ticket(silent[0], "r0"), LOCAL.block_ids)
        clock.now += 2.0
        (result,) = c.poll()
        assert result.error.cause == "timeout" and c.num_handshake_sockets == 0
        with pytest.raises(HandshakeError) as info:
            c.start_read(_ticket(silent[0], "r1"), LOCAL.block_ids)
        assert info.value.cause == "timeout"
    client = HandshakeClient(max_sockets=2)  # the last line of defence: ZeroMQ's own refusal is typed
    try:
        with pytest.raises(HandshakeError) as info:
            client.send("garbage", b"x")
        assert info.value.cause == "unreachable" and client.num_sockets == 0
        client.send(silent[0], b"x")
        client.send(silent[1], b"x")
        with pytest.raises(HandshakeError) as info:
            client.send(silent[2], b"x")
        assert info.value.cause == "capacity" and client.num_sockets == 2
    finally:
        client.close()


# ---- bounds -------------------------------------------------------------------------------------------------
def test_handshake_sockets_and_links_are_capped_and_failed_links_are_evicted_least_recently_used(silent):
    clock = FakeClock()
    config = EngineConfig(handshake_timeout_s=2.0, max_links=2, max_handshake_sockets=2)
    with _consumer(config, clock=clock) as c:
        for i in range(2):
            c.start_read(_ticket(silent[i], f"r{i}", engine_id=f"e{i}"), [LOCAL, OTHER_LOCAL][i].block_ids)
        assert c.num_handshake_sockets == 2 and c.num_links == 2
        with pytest.raises(HandshakeError) as info:  # a third engine would open a third socket
            c.start_read(_ticket(silent[2], "r2", engine_id="e2"), [[0, 1], [2], [3], [4]])
        assert info.value.cause == "capacity" and "max_handshake_sockets=2" in str(info.value)
        assert c.num_handshake_sockets == 2 and not c.is_active("r2")
        clock.now += 2.0
        assert {r.request_id for r in c.poll()} == {"r0", "r1"}  # both timed out: two failed links, no socket
        assert c.num_handshake_sockets == 0 and c.num_links == 2
        c.start_read(_ticket(silent[2], "r2", engine_id="e2"), LOCAL.block_ids)  # evicts e0, the oldest
        assert c.num_links == 2 and c.link_stats.evicted == 1
        assert c.metrics().links_evicted == 1
        c.start_read(_ticket(silent[3], "r3", engine_id="e3"), OTHER_LOCAL.block_ids)  # evicts e1
        assert c.num_links == 2 and c.link_stats.evicted == 2
        with pytest.raises(HandshakeError) as info:  # e2 and e3 are live: no link to evict
            c.start_read(_ticket(silent[4], "r4", engine_id="e4"), [[0, 1], [2], [3], [4]])
        assert info.value.cause == "capacity"
        clock.now += 2.0
        c.poll()
        assert c.num_handshake_sockets == 0


# ---- idle ready links make room (issue 19 Deliver 3: links capped per consumer, the table never stuck) ---------
def _byes_seen(producers, byes: int) -> bool:
    """Poll the producers until they have taken in ``byes`` Byes together (False when they did not in time)."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        for producer in producers:
            producer.poll()
        if sum(p.stats.byes for p in producers) >= byes:
            return True
        time.sleep(0.002)
    return False


@pytest.mark.parametrize("with_secret", [True, False], ids=["secret", "no-secret"])
def test_a_third_engine_evicts_the_idle_least_recently_used_ready_link_and_the_evicted_one_links_again(
        with_secret, tmp_path):
    """Once max_links engines were linked, a ticket for another engine used to fail with "capacity" for good.
    With a secret the link to pa is sealed: after its Bye, pa's second handshake with this agent gets a new key."""
    config = EngineConfig(max_links=2)
    if with_secret:
        path = tmp_path / "secret"
        path.write_bytes(SECRET)
        config = EngineConfig(max_links=2, secret_file=str(path))
    with (_producer(config, engine_id="pa") as a, _producer(config, engine_id="pb") as b,
          _producer(config, engine_id="pc") as p, _consumer(config) as c):
        producers = [a, b, p]
        for producer, seed in zip(producers, (3, 4, 5), strict=True):
            fill_source(producer.cache, LAYOUT, seed)
        _read(c, producers, a.hold("a1", LAYOUT.block_ids, 20), LOCAL, 3)
        _read(c, producers, b.hold("b1", LAYOUT.block_ids, 20), OTHER_LOCAL, 4, [(LOCAL, 3)])
        assert c.num_links == 2 and c.num_peer_records == 2
        _read(c, producers, p.hold("c1", LAYOUT.block_ids, 20), LOCAL, 5, [(OTHER_LOCAL, 4)])  # evicts pa (LRU)
        assert c.num_links == 2 and c.link_stats.evicted_ready == 1 and c.num_peer_records == 2
        assert _byes_seen([a], 1)  # pa was told Bye: it forgot this consumer agent
        _read(c, producers, a.hold("a2", LAYOUT.block_ids, 20), OTHER_LOCAL, 3, [(LOCAL, 5)])  # pa: evicts pb
        assert c.link_stats.evicted_ready == 2 and c.num_links == 2 and c.num_peer_records == 2
        assert c.metrics().links_evicted == 2 and _byes_seen([a, b], 2)
        assert len(c._pack._stages) == 2  # the pack reader's per-agent table went with the evicted links


def test_a_link_a_request_needs_is_never_evicted_and_capacity_is_refused_only_when_every_link_is_busy():
    config = EngineConfig(max_links=2)
    with (_producer(engine_id="pa") as a, _producer(engine_id="pb") as b, _producer(engine_id="pc") as p,
          _consumer(config) as c):
        producers = [a, b, p]
        for producer, seed in zip(producers, (3, 4, 5), strict=True):
            fill_source(producer.cache, LAYOUT, seed)
        _read(c, producers, b.hold("b1", LAYOUT.block_ids, 20), OTHER_LOCAL, 4)
        _read(c, producers, a.hold("a1", LAYOUT.block_ids, 20), LOCAL, 3, [(OTHER_LOCAL, 4)])  # pb is the LRU now
        c.start_read(b.hold("b2", LAYOUT.block_ids, 20), OTHER_LOCAL.block_ids)  # both links busy
        c.start_read(a.hold("a2", LAYOUT.block_ids, 20), LOCAL.block_ids)
        with pytest.raises(HandshakeError) as info:
            c.start_read(p.hold("c1", LAYOUT.block_ids, 20), [[0, 1], [2], [3], [4]])
        assert info.value.cause == "capacity" and c.link_stats.evicted == 0 and c.num_links == 2
        assert _wait(c, [a], "a2").state is ReadState.DONE  # pb is not polled: b2 waits for its claim's answer
        assert c.is_active("b2")
        c.start_read(p.hold("c2", LAYOUT.block_ids, 20), LOCAL.block_ids)  # pa is idle: evicted, pb is busy
        assert c.link_stats.evicted_ready == 1 and c.num_links == 2
        assert _wait(c, producers, "b2").state is ReadState.DONE
        check_destination_many(c.cache, [(OTHER_LOCAL, 4), (LOCAL, 3)])
        assert _wait(c, producers, "c2").state is ReadState.DONE
        check_destination_many(c.cache, [(OTHER_LOCAL, 4), (LOCAL, 5)])
