"""Producer: holds and their validation; notifications that must free nothing (or nothing twice)."""

from __future__ import annotations

import time

import pytest
import zmq
from harness import (
    TINY,
    RankSpec,
    hold_everywhere,
    raw_notify,
    start_consumers,
    start_producers,
    stranger_notify,
)

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Producer, wire
from hybrid_transfer.errors import (
    BlockCountError,
    BlockIdError,
    ConfigError,
    DuplicateBlockError,
    RequestStateError,
)
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.verify import RequestLayout

MODEL = model_from_config(TINY, name="tiny")
WAIT_S = 20.0


@pytest.fixture(scope="module")
def producer():
    p = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 32))
    yield p
    p.close()


def test_hold_pins_blocks_and_returns_a_complete_ticket(producer):
    ticket = producer.hold("a", [[1, 2], [3], [4], [5]], 20)
    assert producer.is_held("a") and producer.num_held_blocks == 5
    assert ticket.addresses == (producer.address,) and ticket.tp_size == 1
    assert ticket.block_ids == ((1, 2), (3,), (4,), (5,)) and ticket.state_position == 20
    assert ticket.engine_id == producer.engine_id and ticket.incarnation == producer.incarnation
    assert ticket.lease_s == producer.config.lease_s
    # Attention blocks may be shared by two requests (prefix caching): pinned once, counted per hold.
    producer.hold("b", [[1], [6], [7], [8]], 5)
    assert producer.num_held_blocks == 8 and producer.num_held_requests == 2
    assert ticket.nonce != producer.hold("c", [[], [9], [10], [11]], 0).nonce


@pytest.mark.parametrize(("block_ids", "num_tokens", "error"), [
    ([[1], [2], [3], [4]], 17, BlockCountError),  # 17 tokens need exactly 2 attention blocks
    ([[1, 2], [3, 4], [5], [6]], 20, BlockCountError),  # a GDN group lists exactly one block
    ([[1, 2], [3], [4], [32]], 20, BlockIdError),
    ([[1, 2], [2], [4], [5]], 20, DuplicateBlockError),
    ([[1, 2], [3], [4]], 20, Exception),
])
def test_bad_block_ids_are_refused_before_anything_is_pinned(producer, block_ids, num_tokens, error):
    before = producer.num_held_blocks
    with pytest.raises(error):
        producer.hold("bad", block_ids, num_tokens)
    assert not producer.is_held("bad") and producer.num_held_blocks == before


def test_a_request_is_held_once(producer):
    producer.hold("once", [[20], [21], [22], [23]], 3)
    with pytest.raises(RequestStateError, match="already held"):
        producer.hold("once", [[24], [25], [26], [27]], 3)


def test_held_blocks_are_capped_and_a_hold_beyond_the_cap_pins_nothing():
    """A client's do_remote_decode pins blocks with nobody reading: max_held_blocks bounds that (docs/limits.md)."""
    from hybrid_transfer.engine import EngineConfig
    from hybrid_transfer.errors import HoldCapacityError

    cache = HybridCache.allocate(RankGeometry(MODEL, 1, 0), 16)
    with Producer(cache, EngineConfig(max_held_blocks=8)) as capped:
        capped.hold("a", [[1, 2], [3], [4], [5]], 20)
        with pytest.raises(HoldCapacityError) as info:
            capped.hold("b", [[6, 7], [8], [9], [10]], 20)
        assert (info.value.held, info.value.asked, info.value.cap, info.value.request_id) == (5, 5, 8, "b")
        assert not capped.is_held("b") and capped.num_held_blocks == 5 and capped.metrics().held_cap == 8
        capped.hold("c", [[1], [6], [7], [8]], 5)  # block 1 is a's already: 3 more, 8 in all
        assert capped.num_held_blocks == 8
        assert capped.abort("a") and capped.poll() == ["a"]  # a's blocks back: room again
        capped.hold("b", [[9], [10], [11], [12]], 4)  # 4 more beside c's 4
    with Producer(cache) as default:
        assert default.held_blocks_cap == int(16 * 0.9) == default.metrics().held_cap


def test_multi_rank_engines_need_addresses_and_rank_zeros_nonce():
    rank1 = Producer(HybridCache.allocate(RankGeometry(MODEL, 2, 1), 8), engine_id="e", incarnation=1)
    try:
        with pytest.raises(ConfigError, match="nonce"):
            rank1.hold("r", [[1], [2], [3], [4]], 4)
        with pytest.raises(ConfigError, match="set_engine_addresses"):
            rank1.hold("r", [[1], [2], [3], [4]], 4, nonce=5)
        with pytest.raises(ConfigError):
            rank1.set_engine_addresses(["tcp://127.0.0.1:1", "tcp://elsewhere:2"])
        rank1.set_engine_addresses(["tcp://127.0.0.1:1", rank1.address])
        assert rank1.hold("r", [[1], [2], [3], [4]], 4, nonce=5).nonce == 5
    finally:
        rank1.close()
        rank1.close()


def _status(worker, key, held=()):
    return worker.call("producer_status", key, tuple(held))


def _wait_stats(worker, key, **expected):
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = _status(worker, key)["stats"]
        if all(stats[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            assert {k: stats[k] for k in expected} == expected
            return stats
        worker.call("settle", 0.02)


def test_stray_notifications_free_nothing_and_are_counted(cluster):
    """1 -> 2 fan-out: the producer rank must hear from two distinct consumer ranks."""
    p_worker, c_workers, stranger = cluster.workers[0], cluster.workers[1:3], cluster.workers[3]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)])
    consumers = start_consumers(c_workers, [RankSpec(TINY, 2, r, 16) for r in range(2)])
    try:
        layout = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
        ticket = wire.decode_ticket(hold_everywhere(producers, "r", layout, seed=5))
        pk = producers.keys[0]
        status = _status(p_worker, pk)
        name, digest = status["agent_name"], status["digest"]
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("connect", k, producers.addresses[0], 10.0)

        def completion(**changes):
            fields = dict(request_id="r", nonce=ticket.nonce, consumer_rank=0, expected_consumers=2) | changes
            return wire.encode(wire.Completion(**fields), digest)

        c0, k0 = consumers.workers[0], consumers.keys[0]
        stranger.call("call", stranger_notify, "stranger-agent", status["metadata"], completion())
        _wait_stats(p_worker, pk, unknown_agent=1)
        c0.call("call", raw_notify, k0, name, completion(nonce=ticket.nonce ^ 1))
        _wait_stats(p_worker, pk, bad_nonce=1)
        c0.call("call", raw_notify, k0, name, b"\x00 not a message")
        c0.call("call", raw_notify, k0, name, wire.encode(wire.Completion(request_id="r", nonce=ticket.nonce,
                                                                    consumer_rank=0, expected_consumers=2), "0" * 16))
        _wait_stats(p_worker, pk, malformed=2)
        c0.call("call", raw_notify, k0, name, completion(request_id="nobody"))
        # Before any claim for its rank a report counts once (docs/lifecycle.md#who-reports): rank 0 read nothing.
        c0.call("call", raw_notify, k0, name, completion())
        c0.call("call", raw_notify, k0, name, completion())
        c0.call("call", raw_notify, k0, name, completion(consumer_rank=1, expected_consumers=1))
        stats = _wait_stats(p_worker, pk, unknown_request=1, completions=1, duplicate=1, inconsistent=1)
        assert stats["freed"] == 0 and _status(p_worker, pk, ["r"])["held"] == ["r"]
        # The second consumer rank reads for real; only then is the request freed, exactly once.
        c1, k1 = consumers.workers[1], consumers.keys[1]
        c1.call("start_read", k1, wire.encode_ticket(ticket), [[0, 1, 2], [3], [4], [5]], 20)
        assert c1.call("wait_done", k1, ["r"], WAIT_S)[0].state == "done"
        assert p_worker.call("wait_freed", pk, ["r"], WAIT_S) == ["r"]
        c0.call("call", raw_notify, k0, name, completion(consumer_rank=1))
        stats = _wait_stats(p_worker, pk, unknown_request=2)
        final = _status(p_worker, pk, ["r"])
        assert stats["freed"] == 1 and stats["completions"] == 2 and final["held"] == []
        assert final["num_held_blocks"] == 0
    finally:
        producers.close()
        consumers.close()


def test_the_listener_survives_garbage_and_serves_the_next_consumer(cluster):
    p_worker, c_worker = cluster.workers[0], cluster.workers[1]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 8)])
    consumers = start_consumers([c_worker], [RankSpec(TINY, 1, 0, 8)])
    ctx = zmq.Context()
    try:
        for frames in ([b"garbage"], [b"\x92\x01"], [b"", b"garbage"]):  # more frames: dropped unanswered (side_channel.py)
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(producers.addresses[0])
            sock.send_multipart(frames)
            assert sock.poll(10_000), "no reply to garbage"
            _, body = wire.decode(sock.recv_multipart()[-1])
            assert isinstance(body, wire.ErrorReply)
            sock.close()
        c_worker.call("connect", consumers.keys[0], producers.addresses[0], 10.0)
        listener = _status(p_worker, producers.keys[0])["listener"]
        assert (listener["accepted"], listener["rejected"], listener["garbage"]) == (1, 0, 3)
    finally:
        ctx.destroy(linger=0)
        producers.close()
        consumers.close()
