"""The producer's staging: what hold() gathers, and what its side channel answers a StagingQuery."""

from __future__ import annotations

import time

import pytest
import torch
from harness import TINY

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import EngineConfig, Producer, wire
from hybrid_transfer.engine.side_channel import HandshakeClient
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.plan.stage_layout import stage_layout
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout, fill_source

MODEL = model_from_config(TINY, name="tiny")
IDS = [[1, 2, 3], [4], [5], [6]]  # 40 tokens at block size 16
WAIT_S = 10.0


@pytest.fixture
def producer():
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=16 << 10)
    p = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 32), config)
    yield p
    p.close()


def _ask(address: str, body, digest: str):
    client = HandshakeClient()
    try:
        client.send(address, wire.encode(body, digest) if not isinstance(body, bytes) else body)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            got = client.receive(50)
            if got:
                return wire.decode(got[0][1])[1]
        raise AssertionError(f"no answer from {address}")
    finally:
        client.close()


def test_hold_stages_the_canonical_layout_and_the_side_channel_says_where(producer):
    digest = producer.fingerprint.digest()
    fill_source(producer.cache, RequestLayout(tuple(map(tuple, IDS)), 40), seed=7)
    ticket = producer.hold("a", IDS, 40)
    reply = _ask(producer.address, wire.StagingQuery(request_id="a", nonce=ticket.nonce, consumer_rank=0), digest)
    layout = stage_layout(producer.geometry, [r.addr for r in producer.cache.regions], IDS, 40)
    assert reply.status is wire.StagingStatus.READY and reply.nbytes == layout.total_bytes
    pool = producer.stager.pool
    staged = pool.tensor[reply.addr - pool.region.addr:][: reply.nbytes]
    raw = [t for t in producer.cache.tensors]
    want = torch.cat([next(t[a - t.data_ptr():][:n] for t in raw if 0 <= a - t.data_ptr() < t.numel())
                      for a, n in zip(layout.addr.tolist(), layout.length.tolist(), strict=True)])
    assert torch.equal(staged, want) and reply.gather_s >= 0
    for query in (wire.StagingQuery(request_id="a", nonce=ticket.nonce + 1, consumer_rank=0),  # not its ticket
                  wire.StagingQuery(request_id="nope", nonce=ticket.nonce, consumer_rank=0)):
        assert _ask(producer.address, query, digest).status is wire.StagingStatus.ABSENT
    wrong = _ask(producer.address, wire.StagingQuery(request_id="a", nonce=ticket.nonce, consumer_rank=0), "x" * 16)
    assert isinstance(wrong, wire.ErrorReply)  # a query of another model's fingerprint
    stats = producer.stager.stats
    assert (stats.staged, stats.ready, stats.absent, stats.malformed) == (1, 1, 2, 1)


def test_a_full_pool_stages_nothing_and_a_freed_request_gives_its_slice_back(producer):
    digest = producer.fingerprint.digest()
    first = producer.hold("a", IDS, 40)
    big = producer.hold("b", [[7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [17], [18], [19]], 150)
    assert producer.stager.stats.pool_full == 1 and not producer.stager.is_staged("b")
    query = wire.StagingQuery(request_id="b", nonce=big.nonce, consumer_rank=0)
    assert _ask(producer.address, query, digest).status is wire.StagingStatus.ABSENT
    assert producer.stager.pool.bytes_in_use > 0
    assert producer.abort("a") and producer.abort("b")  # no consumer ever read: they end at once
    assert sorted(producer.poll()) == ["a", "b"]
    assert producer.stager.pool.bytes_in_use == 0 and producer.stager.pool.num_slices == 0
    query = wire.StagingQuery(request_id="a", nonce=first.nonce, consumer_rank=0)
    assert _ask(producer.address, query, digest).status is wire.StagingStatus.ABSENT


def test_a_producer_that_does_not_stage_answers_a_query_with_an_error():
    p = Producer(HybridCache.allocate(RankGeometry(MODEL, 1, 0), 8))
    try:
        assert p.stager is None
        reply = _ask(p.address, wire.StagingQuery(request_id="a", nonce=1, consumer_rank=0), p.fingerprint.digest())
        assert isinstance(reply, wire.ErrorReply)  # the consumer then reads directly
    finally:
        p.close()
