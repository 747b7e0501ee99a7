"""Metrics snapshots (engine/metrics.py): histogram arithmetic, the byte check, and a real read's figures."""

from __future__ import annotations

import time

import msgspec
from harness import TINY, RankSpec, hold_everywhere, start_producers

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, ReadState, wire
from hybrid_transfer.engine.metrics import (
    LATENCY_BOUNDS_S,
    ConsumerMetrics,
    Histogram,
    ProducerMetrics,
    bytes_agree,
)
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.plan.validate import expected_bytes
from hybrid_transfer.verify import RequestLayout

GEOMETRY = RankGeometry(model_from_config(TINY, name="tiny"), 1, 0)
WAIT_S = 60.0


def test_the_histogram_puts_each_observation_in_its_bucket():
    h = Histogram()
    for s in (0.0, 0.0001, 0.0003, 0.02, 99.0):
        h.observe(s)
    snap = h.snapshot()
    assert snap.count == 5 and snap.max_s == 99.0 and snap.min_s == 0.0
    assert snap.counts[0] == 2  # 0 and the first bound itself (<= bound)
    assert snap.counts[LATENCY_BOUNDS_S.index(0.0005)] == 1
    assert snap.counts[LATENCY_BOUNDS_S.index(0.025)] == 1
    assert snap.counts[-1] == 1  # above every bound
    assert sum(snap.counts) == 5
    assert snap.quantile(0.5) == 0.0005 and snap.quantile(1.0) == 99.0
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=type(snap)) == snap


def test_bytes_agree_exactly_for_coalesced_and_at_least_for_whole_pages():
    assert bytes_agree(PlanMode.COALESCED, 100, 100, False)
    assert not bytes_agree(PlanMode.COALESCED, 101, 100, False)
    assert not bytes_agree(PlanMode.COALESCED, 99, 100, False)
    assert bytes_agree(PlanMode.NAIVE, 128, 100, False) and not bytes_agree(PlanMode.NAIVE, 99, 100, False)
    assert bytes_agree(PlanMode.COALESCED, 128, 100, True) and not bytes_agree(PlanMode.PACK, 99, 100, True)


def producer_snapshot(state, key) -> bytes:
    return msgspec.msgpack.encode(state.ranks[key].engine.metrics())


def _read(c: Consumer, ticket: wire.Ticket, local) -> list:
    c.start_read(ticket, local)
    deadline = time.monotonic() + WAIT_S
    results = []
    while not results and time.monotonic() < deadline:
        results = c.poll()
    return results


def test_a_read_is_counted_and_a_byte_count_difference_fails_it(cluster, monkeypatch):
    producers = start_producers([cluster.workers[0]], [RankSpec(TINY, 1, 0, 16)])
    c = Consumer(HybridCache.allocate(GEOMETRY, 16), EngineConfig())
    try:
        c.connect(producers.addresses[0])
        tokens = 20  # two attention blocks
        first = wire.decode_ticket(hold_everywhere(producers, "r1", RequestLayout(((1, 2), (3,), (4,), (5,)), tokens),
                                                   seed=5))
        [done] = _read(c, first, [[1, 2], [3], [4], [5]])
        assert done.state is ReadState.DONE
        m = c.metrics()
        assert isinstance(m, ConsumerMetrics)
        need = expected_bytes(GEOMETRY, tokens)
        assert (m.done, m.bytes_needed, m.bytes_moved, m.byte_mismatches) == (1, need, need, 0)
        assert m.descriptors == done.num_descriptors > 0 and m.post_to_done.count == 1
        # The layout now "needs" one byte more than the plan moves: the read must fail, never be DONE.
        monkeypatch.setattr(c, "_expected_bytes", lambda n, first=0: expected_bytes(GEOMETRY, n) + 1)
        second = wire.decode_ticket(hold_everywhere(producers, "r2", RequestLayout(((6, 7), (8,), (9,), (10,)),
                                                                                   tokens), seed=6))
        [failed] = _read(c, second, [[6, 7], [8], [9], [10]])
        assert failed.state is ReadState.FAILED and failed.cause.value == "byte_count"
        m = c.metrics()
        assert (m.done, m.failed, m.byte_mismatches, m.failures_by_cause) == (1, 1, 1, {"byte_count": 1})
        assert m.bytes_needed == need and m.post_to_done.count == 1
        assert producers.workers[0].call("wait_freed", producers.keys[0], ["r1", "r2"], WAIT_S) == ["r1", "r2"]
        p = msgspec.msgpack.decode(producers.workers[0].call("call", producer_snapshot, producers.keys[0]),
                                   type=ProducerMetrics)
        assert (p.held_requests, p.pinned_blocks, p.ended.get("freed")) == (0, 0, 2)
        assert p.completions_failed == 1 and p.leases_expired == 0
    finally:
        c.close()
        producers.close()


def test_prometheus_export_has_the_snapshot_fields():
    import prometheus_client  # in the test extra: a missing one fails here, it is never skipped

    from hybrid_transfer.engine.metrics import LatencySummary
    from hybrid_transfer.engine.prometheus import register

    h = Histogram()
    h.observe(0.003)
    snap = ConsumerMetrics(done=3, failed=1, aborted=0, active=0, failures_by_cause={"deadline": 1},
                           bytes_needed=10, bytes_moved=10, byte_mismatches=0, descriptors=4, reads_posted=4,
                           post_to_done=h.snapshot(), quarantined_blocks=0, rejected_messages={"unsealed": 2},
                           unexpected_notifications=0, claims_refused=0, revokes=0)
    assert isinstance(snap.post_to_done, LatencySummary)
    registry = prometheus_client.CollectorRegistry()
    register(lambda: snap, side="consumer", rank=1, registry=registry)
    text = prometheus_client.generate_latest(registry).decode()
    assert 'hybrid_transfer_consumer_done{rank="1"} 3.0' in text
    assert 'hybrid_transfer_consumer_failures_by_cause{key="deadline",rank="1"} 1.0' in text
    assert 'hybrid_transfer_consumer_rejected_messages{key="unsealed",rank="1"} 2.0' in text
    assert 'hybrid_transfer_consumer_post_to_done_seconds_count{rank="1"} 1.0' in text
    assert 'hybrid_transfer_consumer_post_to_done_seconds_bucket{le="0.005",rank="1"} 1.0' in text
