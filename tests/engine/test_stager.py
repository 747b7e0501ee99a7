"""The producer's staging: what hold() gathers, and the ready notifications it hands the producer."""

from __future__ import annotations

import pytest
import torch
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import EngineConfig, Producer, wire
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.plan.stage_layout import stage_layout
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout, fill_source

MODEL = model_from_config(TINY, name="tiny")
IDS = [[1, 2, 3], [4], [5], [6]]  # 40 tokens at block size 16


@pytest.fixture
def producer():
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=16 << 10)
    p = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 32), config)
    yield p
    p.close()


def test_hold_stages_the_canonical_layout_and_the_ready_notification_says_where(producer):
    fill_source(producer.cache, RequestLayout(tuple(map(tuple, IDS)), 40), seed=7)
    ticket = producer.hold("a", IDS, 40)  # CPU: gathered inside hold, announced to the (no) welcomed agents
    (note,) = producer.stager.current()
    layout = stage_layout(producer.geometry, [r.addr for r in producer.cache.regions], IDS, 40)
    assert (note.request_id, note.nonce, note.status) == ("a", ticket.nonce, wire.StagingStatus.READY)
    assert note.nbytes == layout.total_bytes and note.gather_s >= 0
    pool = producer.stager.pool
    staged = pool.tensor[note.addr - pool.region.addr:][: note.nbytes]
    raw = list(producer.cache.tensors)
    want = torch.cat([next(t[a - t.data_ptr():][:n] for t in raw if 0 <= a - t.data_ptr() < t.numel())
                      for a, n in zip(layout.addr.tolist(), layout.length.tolist(), strict=True)])
    assert torch.equal(staged, want)
    assert producer.stager.ready() == []  # announced once
    assert wire.decode(wire.encode(note, producer.fingerprint.digest()))[1] == note
    assert producer.stager.stats.announced == 1


def test_a_full_pool_is_announced_absent_and_a_freed_request_gives_its_slice_back(producer):
    producer.hold("a", IDS, 40)
    big = producer.hold("b", [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [17], [18], [19]], 150)
    assert producer.stager.stats.pool_full == 1 and not producer.stager.is_staged("b")
    notes = {n.request_id: n for n in producer.stager.current()}
    assert notes["b"].status is wire.StagingStatus.ABSENT and notes["b"].nonce == big.nonce
    assert notes["a"].status is wire.StagingStatus.READY
    producer.hold("z", [[], [21], [22], [23]], 0)  # zero tokens: nothing to read, nothing announced
    assert sorted(n.request_id for n in producer.stager.current()) == ["a", "b"]
    assert producer.stager.pool.bytes_in_use > 0
    assert producer.abort("a") and producer.abort("b")  # no consumer ever read: they end at once
    assert sorted(producer.poll()) == ["a", "b"]
    assert producer.stager.pool.bytes_in_use == 0 and producer.stager.pool.num_slices == 0
    assert producer.stager.current() == []


def test_a_producer_that_does_not_stage_has_no_stager():
    p = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 8))
    try:
        assert p.stager is None  # its Welcome says stages=False: consumers read from it directly
    finally:
        p.close()
