"""Bitwise transfers through real NIXL agents on separate processes, checked by the global oracle."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
from harness import TINY, RankSpec, hold_everywhere, start_consumers, start_producers

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.layout import CacheOptions, KVLayout
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout, make_requests

NUM_BLOCKS = 64
# (prefill TP, decode TP, producer options, consumer options): every pair of the planner's cases, with
# block sizes that differ between the sides (and kernel blocks smaller than logical ones) in four.
# The default KV layout is interleaved (vLLM 0.33's [heads][tokens][K|V]).
TOPOLOGIES = {
    "1->1": (1, 1, None, None),
    "1->2": (1, 2, CacheOptions(block_size=32, kernel_block_size=16), None),
    "2->4": (2, 4, None, CacheOptions(block_size=32)),
    "4->2": (4, 2, None, None),
    "2->1": (2, 1, CacheOptions(block_size=32), CacheOptions(block_size=64, kernel_block_size=16)),
    "4->1": (4, 1, None, CacheOptions(block_size=48, kernel_block_size=16)),
}
SPLIT = KVLayout.SPLIT
# Several requests in flight per pair: partial last blocks, a whole-block count, one token, zero tokens.
TOKEN_COUNTS = [37, 64, 1, 0, 100]


def _transfer(cluster, prefill_tp, decode_tp, p_opts, c_opts, mode, model=TINY, num_blocks=NUM_BLOCKS,
              token_counts=TOKEN_COUNTS, seed=0, post_thread=None):
    """Move several requests, then check every byte: valid bytes hold the pattern, the rest poison
    (naive moves whole attention pages like vLLM, so the unused tail of the last page is not checked)."""
    p_specs = [RankSpec(model, prefill_tp, r, num_blocks, p_opts) for r in range(prefill_tp)]
    c_specs = [RankSpec(model, decode_tp, r, num_blocks, c_opts) for r in range(decode_tp)]
    workers = cluster.workers
    producers = start_producers(workers[:prefill_tp], p_specs)
    consumers = start_consumers(workers[prefill_tp:prefill_tp + decode_tp], c_specs, EngineConfig(mode=mode,
                                                                                             post_thread=post_thread))
    try:
        rng = np.random.default_rng(seed)
        remote_layouts = _layouts(p_specs[0].geometry(), token_counts, num_blocks, rng, extra=0)
        local_layouts = _layouts(c_specs[0].geometry(), token_counts, num_blocks, rng, extra=1)
        ids = [f"req-{i}" for i in range(len(token_counts))]
        tickets = [hold_everywhere(producers, rid, layout, seed=1000 + i)
                   for i, (rid, layout) in enumerate(zip(ids, remote_layouts, strict=True))]
        # Fan-out: the first consumer rank reads alone first; its producer rank must keep waiting.
        stages = [[0], list(range(1, decode_tp))] if decode_tp > prefill_tp else [list(range(decode_tp))]
        for stage in stages:
            for d in stage:
                for ticket, layout in zip(tickets, local_layouts, strict=True):
                    consumers.workers[d].call("start_read", consumers.keys[d], ticket, layout.block_ids,
                                              layout.num_tokens)
            for d in stage:
                results = consumers.workers[d].call("wait_done", consumers.keys[d], ids, 60.0)
                assert [r.state for r in results] == ["done"] * len(ids), results
                zero = [r for r, n in zip(results, token_counts, strict=True) if n == 0]
                assert all(r.num_bytes == 0 and r.num_descriptors == 0 for r in zero)
            if stage != stages[-1]:
                producers.workers[0].call("settle", 0.2)
                assert producers.workers[0].call("producer_status", producers.keys[0], ids)["held"] == ids
        for w, k in zip(producers.workers, producers.keys, strict=True):
            assert w.call("wait_freed", k, ids, 30.0) == sorted(ids)
            status = w.call("producer_status", k)
            assert status["num_held_blocks"] == 0 and status["num_held_requests"] == 0
            assert status["stats"]["freed"] == len(ids)
        # Bytes: every consumer rank holds exactly its share of every request, poison elsewhere.
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("check", k, [(layout, 1000 + i) for i, layout in enumerate(local_layouts)],
                   mode is PlanMode.NAIVE)
        return consumers
    finally:
        producers.close()
        consumers.close()


def _layouts(geometry, token_counts, num_blocks, rng, extra):
    """Disjoint requests in the given order: even ones contiguous (low half of the pool), odd ones
    fragmented (random ids in random order from the high half)."""
    half = num_blocks // 2
    even = iter(make_requests(geometry, token_counts[0::2], half, rng, 0.0, extra))
    odd = iter(make_requests(geometry, token_counts[1::2], half, rng, 1.0, extra))
    out = []
    for i in range(len(token_counts)):
        if i % 2 == 0:
            out.append(next(even))
        else:
            r = next(odd)
            out.append(RequestLayout(tuple(tuple(b + half for b in g) for g in r.block_ids), r.num_tokens))
    return out


@pytest.mark.parametrize("mode", [PlanMode.COALESCED, PlanMode.NAIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("topology", list(TOPOLOGIES))
def test_transfer_is_bitwise_exact_and_frees_every_producer_block(cluster, topology, mode):
    prefill_tp, decode_tp, p_opts, c_opts = TOPOLOGIES[topology]
    _transfer(cluster, prefill_tp, decode_tp, p_opts, c_opts, mode)


@pytest.mark.parametrize("mode", [PlanMode.COALESCED, PlanMode.NAIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("topology", ["2->4", "4->1"])
def test_split_layout_transfer_is_bitwise_exact(cluster, topology, mode):
    """The older [K | V] page layout still moves exactly, with different block sizes and fan-in."""
    prefill_tp, decode_tp, p_opts, c_opts = TOPOLOGIES[topology]

    def split(opts):
        return CacheOptions(kv_layout=SPLIT) if opts is None else msgspec.structs.replace(opts, kv_layout=SPLIT)

    _transfer(cluster, prefill_tp, decode_tp, split(p_opts), split(c_opts), mode)


def test_transfer_of_a_real_preset_geometry(cluster):
    """qwen3.5-0.8b pages (about 1 MiB each) fan out 1 -> 2: real descriptor sizes, still a small cache."""
    _transfer(cluster, 1, 2, None, None, PlanMode.COALESCED, model="qwen3.5-0.8b", num_blocks=12,
              token_counts=[600, 0])


@pytest.mark.parametrize("mode", [PlanMode.COALESCED, PlanMode.NAIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("topology", ["1->2", "4->1"])
def test_posting_thread_moves_every_byte_exactly(cluster, topology, mode):
    """READs created and posted on the consumer's second thread (engine/poster.py): several requests in
    flight per rank, fan-out and fan-in, still exact, every producer block freed."""
    prefill_tp, decode_tp, p_opts, c_opts = TOPOLOGIES[topology]
    _transfer(cluster, prefill_tp, decode_tp, p_opts, c_opts, mode, post_thread=True)
