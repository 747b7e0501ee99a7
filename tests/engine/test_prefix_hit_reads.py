"""A decode rank with a local prefix hit reads only past it (Consumer.start_read's ``first_token``), over real
NIXL from a producer in another process: every byte past the hit lands, the hit's blocks stay as they were,
and two reads sharing the hit's blocks run side by side (docs/planner.md#prefix-hits)."""

from __future__ import annotations

import time

import pytest
from harness import TINY, RankSpec, hold_everywhere, start_producers

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, ReadState, wire
from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout import RankGeometry, model_from_config
from hybrid_transfer.plan.validate import expected_bytes
from hybrid_transfer.verify import RequestLayout, check_destination_many, poison

GEOMETRY = RankGeometry(model_from_config(TINY, name="tiny"), 1, 0)
BLOCK = GEOMETRY.block_size
WAIT_S = 60.0


def _wait(c: Consumer, count: int) -> list:
    deadline = time.monotonic() + WAIT_S
    results: list = []
    while len(results) < count and time.monotonic() < deadline:
        results += c.poll()
    return results


def test_two_reads_over_one_shared_hit_move_only_their_suffix_and_state(cluster):
    producers = start_producers([cluster.workers[0]], [RankSpec(TINY, 1, 0, 24)])
    cache = HybridCache.allocate(GEOMETRY, 24)
    poison(cache)
    c = Consumer(cache, EngineConfig())
    try:
        c.connect(producers.addresses[0])
        n = 3 * BLOCK - 3  # the hit is the first block; the last block is partial
        remote_a, remote_b = RequestLayout(((1, 2, 3), (4,), (5,), (6,)), n), \
            RequestLayout(((7, 8, 9), (10,), (11,), (12,)), n)
        tickets = [wire.decode_ticket(hold_everywhere(producers, rid, layout, seed=seed))
                   for rid, layout, seed in (("a", remote_a, 3), ("b", remote_b, 4))]
        # Both decode requests start with the same cached block 1 (shared, never written by either read).
        local_a = RequestLayout(((1, 2, 3), (4,), (5,), (6,)), n, first_token=BLOCK)
        local_b = RequestLayout(((1, 7, 8), (9,), (10,), (11,)), n, first_token=BLOCK)
        errors = c.start_reads([(tickets[0], local_a.block_ids, None, BLOCK),
                                (tickets[1], local_b.block_ids, None, BLOCK)])
        assert errors == [None, None]
        results = {r.request_id: r for r in _wait(c, 2)}
        assert {rid: r.state for rid, r in results.items()} == {"a": ReadState.DONE, "b": ReadState.DONE}
        saved = BLOCK * GEOMETRY.kv_bytes_per_token * len(GEOMETRY.model.attention_layers)
        for r in results.values():
            assert r.num_bytes == expected_bytes(GEOMETRY, n) - saved
        assert results["a"].local_block_ids[0] == (2, 3) and results["b"].local_block_ids[0] == (7, 8)
        # Every byte past the hit as the producers wrote it; block 1 (and everything else) still poison.
        check_destination_many(cache, [(local_a, 3), (local_b, 4)])
        assert producers.workers[0].call("wait_freed", producers.keys[0], ["a", "b"], WAIT_S) == ["a", "b"]
    finally:
        c.close()
        producers.close()


def test_a_hit_off_a_block_boundary_is_refused_before_anything_moves(cluster):
    producers = start_producers([cluster.workers[0]], [RankSpec(TINY, 1, 0, 8)])
    c = Consumer(HybridCache.allocate(GEOMETRY, 8), EngineConfig())
    try:
        ticket = wire.decode_ticket(hold_everywhere(producers, "c", RequestLayout(((1, 2), (3,), (4,), (5,)),
                                                                                  2 * BLOCK), seed=1))
        with pytest.raises(PlanError, match=f"first_token={BLOCK - 1}"):
            c.start_read(ticket, [[1, 2], [3], [4], [5]], first_token=BLOCK - 1)
        assert c.num_active == 0 and c.num_links == 0
    finally:
        c.close()
        producers.close()
