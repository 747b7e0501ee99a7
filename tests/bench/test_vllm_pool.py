"""bench/vllm_pool.py: the free queue's bookkeeping against a plain-list oracle, the churn, the bench's layouts.

tests/vllm/test_vllm_pool_trace.py checks the same ids against vLLM 0.33's real KVCacheManager.
"""

from __future__ import annotations

import argparse

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.bench import sizing, vllm_pool
from hybrid_transfer.bench.spec import BenchSpec, Sweep
from hybrid_transfer.bench.vllm_pool import Arrive, BlockPoolSim, Churn, Finish, churn_trace, replay
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import RankGeometry, load_preset

GROUPS = (16, None, None, None)  # one attention group of 16-token blocks, three state groups (the tiny model)


def test_fresh_pool_hands_out_ids_from_1_group_by_group():
    pool = BlockPoolSim(20, GROUPS)
    assert pool.allocate(0, 40) == [[1, 2, 3], [4], [5], [6]]  # block 0 is vLLM's null block
    assert pool.allocate(1, 16) == [[7], [8], [9], [10]]
    assert pool.num_free == 20 - 1 - 10


def test_free_puts_each_group_last_first_at_the_head_last_group_first():
    pool = BlockPoolSim(20, GROUPS)
    pool.allocate(0, 40)
    pool.free(0)
    # Groups freed in order, each prepended last-first: group 3's block ends up at the head.
    assert list(pool.free_queue)[:6] == [6, 5, 4, 3, 2, 1]
    assert list(pool.free_queue)[6:] == list(range(7, 20))
    assert pool.allocate(1, 40) == [[6, 5, 4], [3], [2], [1]]


def test_short_pool_and_bad_requests_fail_with_the_numbers():
    pool = BlockPoolSim(6, GROUPS)
    with pytest.raises(ConfigError, match="needs 6 blocks, 5 of 6 are free"):
        pool.allocate(0, 40)
    pool.allocate(0, 16)
    with pytest.raises(ConfigError, match="request 0 already holds blocks"):
        pool.allocate(0, 16)
    with pytest.raises(ConfigError, match="request 7 holds no blocks"):
        pool.free(7)
    with pytest.raises(ConfigError, match="num_blocks=1"):
        BlockPoolSim(1, GROUPS)


class ListPool:
    """The oracle: vLLM's queue as a plain list (head at index 0), written from the same reading of
    block_pool.py, without a deque."""

    def __init__(self, num_blocks, sizes):
        self.queue = list(range(num_blocks))[1:]
        self.sizes = sizes
        self.owned = {}

    def allocate(self, request, tokens):
        ids = []
        for b in self.sizes:
            n = (tokens + b - 1) // b if b else 1
            ids.append(self.queue[:n])
            self.queue = self.queue[n:]
        self.owned[request] = ids
        return ids

    def free(self, request):
        for group in self.owned.pop(request):
            self.queue = list(reversed(group)) + self.queue


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32), tokens=st.integers(1, 200), live=st.integers(1, 6), timed=st.integers(1, 6),
       block=st.sampled_from([1, 16, 64]))
def test_replay_matches_the_list_oracle_and_live_ids_never_overlap(seed, tokens, live, timed, block):
    live = max(live, timed)
    sizes = (block, None, None)
    churn = Churn(tokens=tokens, timed=timed, live=live, turnovers=3)
    events = churn_trace(churn, seed)
    num_blocks = vllm_pool.pool_size(sizes, tokens, live)
    oracle = ListPool(num_blocks, sizes)
    got = replay(events, num_blocks, sizes)
    held: dict[int, set[int]] = {}
    for ev in events:
        if isinstance(ev, Arrive):
            assert got[ev.request] == oracle.allocate(ev.request, ev.tokens)
            ids = {b for g in got[ev.request] for b in g}
            assert all(0 < b < num_blocks for b in ids)
            assert not any(ids & other for other in held.values())
            held[ev.request] = ids
        else:
            oracle.free(ev.request)
            del held[ev.request]
        assert len(held) <= live


def test_churn_is_deterministic_bounded_and_keeps_the_timed_requests():
    churn = Churn(tokens=1000, timed=3, live=5)
    events = churn_trace(churn, 7)
    assert events == churn_trace(churn, 7)
    assert events != churn_trace(churn, 8)
    arrivals = [e for e in events if isinstance(e, Arrive)]
    finished = {e.request for e in events if isinstance(e, Finish)}
    assert len(arrivals) == vllm_pool.TURNOVERS * 5 + 3
    assert [a.request for a in arrivals[-3:]] == list(churn.timed_ids)
    assert all(a.tokens == 1000 for a in arrivals[-3:])
    assert all(800 <= a.tokens <= 1000 for a in arrivals)
    assert len({a.tokens for a in arrivals[:-3]}) > 1  # churn lengths vary
    assert not finished & set(churn.timed_ids)
    assert len(arrivals) - len(finished) == 5  # the pool ends full: live requests, the timed ones among them


@pytest.mark.parametrize("bad", [dict(tokens=0), dict(timed=0), dict(live=2, timed=3), dict(turnovers=-1)])
def test_churn_refuses_bad_values(bad):
    args = dict(tokens=100, timed=3, live=4) | bad
    name = next(iter(bad)) if "live" not in bad else "live"
    with pytest.raises(ConfigError, match=f"vllm-pool {name}="):
        churn_trace(Churn(**args), 0)


def test_vllm_order_lists_the_kind_of_layer_0_first(tiny_model):
    from hybrid_transfer.layout.model import LayerKind

    geo = RankGeometry(tiny_model, 1, 0)
    assert tiny_model.layer_kinds[0] is LayerKind.GDN
    assert [g.kind for g in geo.tensor_map.groups][0] is LayerKind.ATTENTION  # ours: attention first
    assert vllm_pool.vllm_group_order(geo) == (1, 2, 3, 0)
    assert vllm_pool.group_block_sizes(geo) == (None, None, None, geo.block_size)
    # the bench's layouts come back in our order: a fresh pool gives the GDN groups ids 1, 2, 3
    churn_free = vllm_pool.pool_layouts(geo, geo.block_size * 2, 1, vllm_pool.bench_pool_blocks(geo, 1, 1) + 200, 0)
    assert [len(g) for g in churn_free[0].block_ids] == [2, 1, 1, 1]


@pytest.mark.parametrize(("preset", "tp", "tokens"), [("qwen3.5-0.8b", 1, 2048), ("qwen3.5-397b-a17b", 8, 8192)])
def test_pool_layouts_fit_the_request_model(preset, tp, tokens):
    geo = RankGeometry(load_preset(preset), tp, 0)
    num_blocks = vllm_pool.bench_pool_blocks(geo, tokens, 4)
    layouts = vllm_pool.pool_layouts(geo, tokens, 4, num_blocks, seed=3)
    assert len(layouts) == 4
    want = [geo.num_blocks_for_tokens(tokens)] + [1] * (len(geo.tensor_map.groups) - 1)
    every = [b for lay in layouts for g in lay.block_ids for b in g]
    for lay in layouts:
        assert lay.num_tokens == tokens
        assert [len(g) for g in lay.block_ids] == want
    assert len(set(every)) == len(every) and 0 < min(every) and max(every) < num_blocks
    assert num_blocks == 1 + vllm_pool.LIVE_PER_TIMED * 4 * sum(want)


def test_bench_layouts_under_vllm_pool_are_independent_per_side_and_seeded():
    spec = BenchSpec(tokens=2048, requests=4, allocation="vllm-pool").validate()
    prod, cons = sizing.layouts(spec, spec.points[0], 0)
    again = sizing.layouts(spec, spec.points[0], 0)
    other = sizing.layouts(BenchSpec(tokens=2048, requests=4, allocation="vllm-pool", seed=1), spec.points[0], 0)
    assert (prod, cons) == again
    assert prod != cons  # each side its own churn
    assert (prod, cons) != other
    assert sizing.pool_blocks(spec, True) == vllm_pool.bench_pool_blocks(sizing.geometry(spec, True), 2048, 4)
    # the fragmentation model keeps its exact pool
    plain = BenchSpec(tokens=2048, requests=4).validate()
    assert sizing.pool_blocks(plain, True) == 4 * sizing.blocks_per_request(sizing.geometry(plain, True), 2048)


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(allocation="lru"), "allocation='lru' must be one of"),
    (dict(allocation="vllm-pool", fragmentation=0.5), "drop --fragmentation"),
    (dict(allocation="vllm-pool", sweep=Sweep.FRAGMENTATION), "drop --fragmentation"),
    (dict(allocation="vllm-pool", tokens=0), "tokens=0 must be >= 1 with --allocation vllm-pool"),
])
def test_spec_refuses_allocation_conflicts(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        BenchSpec(**kwargs).validate()


def test_cli_option_reaches_the_spec():
    from hybrid_transfer.cli import bench_cmd

    parser = argparse.ArgumentParser()
    bench_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["bench", "--allocation", "vllm-pool", "--tokens", "600"])
    assert bench_cmd.spec_from_args(args).allocation == "vllm-pool"
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--allocation", "random"])
