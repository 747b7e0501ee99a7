"""Block pools, request layouts and ceiling sizes agree with the request model and the planner."""

from __future__ import annotations

import msgspec
import pytest

from hybrid_transfer.bench import sizing
from hybrid_transfer.bench.spec import BenchSpec, Point, Sweep
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import fake_engine


@pytest.mark.parametrize("p, d", [(1, 1), (2, 8), (4, 2)])
@pytest.mark.parametrize("fragmentation", [0.0, 1.0])
def test_layouts_are_disjoint_and_fit_the_pools(p, d, fragmentation):
    spec = BenchSpec(preset="qwen3.5-397b-a17b", prefill_tp=p, decode_tp=d, tokens=3000, requests=3)
    point = Point(3000, fragmentation)
    for is_prefill, layouts in zip((True, False), sizing.layouts(spec, point, 0), strict=True):
        pool = sizing.pool_blocks(spec, is_prefill)
        ids = [b for layout in layouts for group in layout.block_ids for b in group]
        assert len(ids) == len(set(ids)) == pool  # the pool holds exactly R requests
        assert all(0 <= b < pool for b in ids)
        geo = sizing.geometry(spec, is_prefill)
        assert all(len(layout.block_ids) == len(geo.tensor_map.groups) for layout in layouts)


def test_fragmented_layouts_are_not_one_ascending_run():
    spec = BenchSpec(tokens=8192, requests=4)
    contiguous, _ = sizing.layouts(spec, Point(8192, 0.0), 0)
    shuffled, _ = sizing.layouts(spec, Point(8192, 1.0), 0)
    flat = lambda layouts: [b for x in layouts for g in x.block_ids for b in g]  # noqa: E731
    assert flat(contiguous) == sorted(flat(contiguous))
    assert flat(shuffled) != sorted(flat(shuffled))


@pytest.mark.parametrize("p, d", [(1, 1), (2, 8), (4, 2), (1, 2)])
def test_source_bytes_add_up_to_what_each_decode_rank_receives(p, d):
    spec = BenchSpec(preset="qwen3.5-397b-a17b", prefill_tp=p, decode_tp=d)
    per_rank = sizing.source_bytes(spec, 8192)
    assert len(per_rank) == d
    model = sizing.geometry(spec, True).model
    producers = fake_engine(model, p, None, 8)
    for rank, per_source in enumerate(per_rank):
        expected = Planner(model, fake_engine(model, d, None, 8, 1)[rank], producers).expected_bytes(8192)
        assert sum(per_source.values()) == expected


def test_design_worked_example_bytes_per_decode_rank():
    """docs/planner.md#worked-example: qwen3.5-397b-a17b, 8192 tokens, P2 -> D8 moves 149,836,800 B into each decode rank."""
    spec = BenchSpec(preset="qwen3.5-397b-a17b", prefill_tp=2, decode_tp=8)
    assert all(sum(x.values()) == 149_836_800 for x in sizing.source_bytes(spec, 8192))


def test_ceiling_sizes_cover_the_largest_point_and_concurrency():
    spec = BenchSpec(prefill_tp=1, decode_tp=2, requests=3, concurrency=8, sweep=Sweep.TOKENS,
                     sweep_values=(64.0, 2048.0))
    c = sizing.ceiling_sizes(spec)
    assert c.slots == 3  # never more slots than requests
    largest = sizing.source_bytes(spec, 2048)
    assert c.dst_slot_bytes == tuple(sum(x.values()) for x in largest)
    assert c.src_slot_bytes == (max(x[0] for x in largest),)
    mem = sizing.memory_estimate(spec, c)
    assert mem.total_bytes == mem.prefill_rank_bytes + 2 * mem.decode_rank_bytes


def test_verify_doubles_the_decode_cache_estimate():
    plain, checked = BenchSpec(requests=2), BenchSpec(requests=2, verify=True)
    c = sizing.ceiling_sizes(plain)
    geo = sizing.geometry(plain, False)
    cache = geo.num_tensors * geo.page_bytes * sizing.pool_blocks(plain, False)
    assert sizing.memory_estimate(checked, c).decode_rank_bytes - sizing.memory_estimate(plain, c).decode_rank_bytes \
        == cache


def test_pack_adds_each_sides_staging_pool():
    from hybrid_transfer.plan.types import PlanMode

    plain, pack = BenchSpec(requests=3, concurrency=2), BenchSpec(requests=3, concurrency=2, mode=PlanMode.PACK)
    c = sizing.ceiling_sizes(plain)
    a, b = sizing.memory_estimate(plain, c), sizing.memory_estimate(pack, c)
    assert b.prefill_rank_bytes - a.prefill_rank_bytes == sizing.staging_bytes(pack, True)
    assert b.decode_rank_bytes - a.decode_rank_bytes == sizing.staging_bytes(pack, False)
    # A producer stages every request it holds, a consumer only those in flight.
    assert sizing.staging_bytes(pack, True) > sizing.staging_bytes(pack, False)


def _long(requests: int, **kw) -> BenchSpec:
    return BenchSpec(preset="qwen3.5-397b-a17b", prefill_tp=2, decode_tp=8, tokens=131072, requests=requests,
                     concurrency=1, verify=True, **kw).validate()


def test_device_bytes_put_every_rank_on_its_gpu_and_grow_with_requests():
    one, two = _long(1), _long(2)
    n1 = sizing.device_bytes(one, sizing.ceiling_sizes(one))
    n2 = sizing.device_bytes(two, sizing.ceiling_sizes(two))
    assert set(n1) == {0} and n2[0] > n1[0]
    # Each request's bytes sit at least in the prefill and the decode caches of its GPU.
    per_request = sum(sum(d.values()) for d in sizing.source_bytes(one, 131072))
    assert n2[0] - n1[0] >= 2 * per_request
    split = _long(1, prefill_gpus=(0,), decode_gpus=(1,))
    placed = sizing.device_bytes(split, sizing.ceiling_sizes(split))
    assert set(placed) == {0, 1} and sum(placed.values()) == n1[0]


def test_a_request_count_that_cannot_fit_a_gpu_is_refused_with_the_figures():
    spec = _long(4)
    capacity = {0: 139 * 2**30}
    with pytest.raises(ConfigError) as info:
        sizing.check_device_memory(spec, capacity, 0.92)
    message = str(info.value)
    need = sizing.device_bytes(spec, sizing.ceiling_sizes(spec))[0]
    assert f"{need / 2**30:.1f} GiB" in message and "139.0 GiB" in message and "131,072 tokens" in message
    best = sizing.fitting_requests(spec, lambda t: sizing.device_bytes(t, sizing.ceiling_sizes(t))[0]
                                   <= 0.92 * capacity[0])
    assert 1 <= best < 4 and f"--requests {best}" in message
    assert info.value.field == "requests" and info.value.value == 4
    sizing.check_device_memory(msgspec.structs.replace(spec, requests=best), capacity, 0.92)  # that one fits
    with pytest.raises(ConfigError, match="no --requests fits"):
        sizing.check_device_memory(spec, {0: 2**30}, 0.92)


def test_a_token_sweep_is_sized_for_its_largest_point():
    sweep = BenchSpec(preset="qwen3.5-397b-a17b", tokens=8192, requests=2, sweep=Sweep.TOKENS,
                      sweep_values=(8192.0, 32768.0)).validate()
    largest = BenchSpec(preset="qwen3.5-397b-a17b", tokens=32768, requests=2).validate()
    assert sizing.device_bytes(sweep, sizing.ceiling_sizes(sweep)) == \
        sizing.device_bytes(largest, sizing.ceiling_sizes(largest))


def test_each_point_of_a_token_sweep_gets_pools_sized_to_its_tokens():
    from hybrid_transfer.bench.coordinator import point_spec

    spec = BenchSpec(preset="qwen3.5-397b-a17b", tokens=8192, requests=2, sweep=Sweep.TOKENS,
                     sweep_values=(8192.0, 131072.0)).validate()
    small, large = (point_spec(spec, p) for p in spec.points)
    assert (small.tokens, large.tokens) == (8192, 131072) and small.sweep is Sweep.NONE
    for is_prefill in (True, False):
        assert sizing.pool_blocks(large, is_prefill) == sizing.pool_blocks(spec, is_prefill)
        assert sizing.pool_blocks(small, is_prefill) < sizing.pool_blocks(spec, is_prefill) // 8
    layouts = sizing.layouts(small, spec.points[0], 0)[0]  # ids fit the small point's own pool
    assert max(b for layout in layouts for g in layout.block_ids for b in g) < sizing.pool_blocks(small, True)
