"""The canonical staging layout: gather by atoms, read the mapped ranges, scatter, and every byte is right.

The oracle is verify.py's global-coordinate pattern (it never sees a layout); the copies here are
plain numpy slices, one per atom, range and piece, independent of the engine's index kernels.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from test_planner_properties import engine, scenarios

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout import RankGeometry, load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import geometry_from_descriptor
from hybrid_transfer.plan.stage_layout import StagedRead, map_rows, stage_layout
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import check_destination, fill_source, poison


def _bytes_at(caches, addr: int, length: int) -> np.ndarray:
    for cache in caches:
        for t in cache.tensors:
            off = addr - t.data_ptr()
            if 0 <= off and off + length <= t.numel():
                return t.numpy()[off : off + length]
    raise AssertionError(f"{length} B at {addr:#x} is in no tensor")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios())
def test_pack_through_the_canonical_layout_moves_exactly_the_right_bytes(s):
    rng = np.random.default_rng(s["seed"])
    model, n = s["model"], s["tokens"]
    pre, pre_descs, pre_req = engine(model, s["p"], s["prefill"], n, s["spare"], rng, s["fragmentation"])
    dec, dec_descs, dec_req = engine(model, s["d"], s["decode"], n, s["spare"], rng, s["fragmentation"],
                                     s["extra_local"])
    staged = {}
    for rank, (cache, desc) in enumerate(zip(pre, pre_descs, strict=True)):
        poison(cache)
        fill_source(cache, pre_req, s["seed"])
        layout = stage_layout(geometry_from_descriptor(model, desc), desc.tensor_addrs, pre_req.block_ids, n)
        assert np.array_equal(layout.offset, np.cumsum(layout.length) - layout.length)
        staging = np.concatenate([_bytes_at([cache], a, ln) for a, ln in zip(layout.addr.tolist(),
                                                                            layout.length.tolist(), strict=True)]
                                 or [np.empty(0, np.uint8)])
        staged[rank] = (layout, staging)
    for rank, cache in enumerate(dec):
        poison(cache)
        planner = Planner(model, dec_descs[rank], pre_descs)
        plan = planner.plan(dec_req.block_ids, pre_req.block_ids, n, PlanMode.COALESCED)
        first = planner.plan(dec_req.block_ids, pre_req.block_ids, n, PlanMode.PACK)  # maps the direct rows
        packed = planner.plan(dec_req.block_ids, pre_req.block_ids, n, PlanMode.PACK)  # the shape's recipe
        assert len(packed.sources) == len(first.sources) == len(plan.sources)
        for src, pack in zip(plan.sources, packed.sources, strict=True):
            layout, staging = staged[src.source_rank]
            read = map_rows(layout, src.local_addr, src.remote_addr, src.length)
            # Cutting one tensor's rows for all (tiles) maps them alike.
            tiled = map_rows(layout, src.local_addr, src.remote_addr, src.length,
                             len(pre_descs[src.source_rank].tensor_addrs))
            for name in StagedRead.__dataclass_fields__:
                np.testing.assert_array_equal(getattr(tiled, name), getattr(read, name), err_msg=f"tiled {name}")
            # The planner's per-shape pack recipe gives what mapping the direct rows gives.
            for name in ("addr", "length", "offset"):
                np.testing.assert_array_equal(getattr(pack.layout, name), getattr(layout, name))
            for name in StagedRead.__dataclass_fields__:
                np.testing.assert_array_equal(getattr(pack.read, name), getattr(read, name), err_msg=name)
            assert read.total_bytes == src.total_bytes == int(read.scatter_length.sum())
            assert read.num_ranges <= 2, (read.num_ranges, s["p"], s["d"])
            local = np.concatenate([staging[o : o + ln] for o, ln in zip(read.remote_offset.tolist(),
                                                                         read.length.tolist(), strict=True)])
            for a, b, ln in zip(read.scatter_src.tolist(), read.scatter_dst.tolist(), read.scatter_length.tolist(),
                                strict=True):
                _bytes_at([cache], b, ln)[:] = local[a : a + ln]
        check_destination(cache, dec_req, s["seed"])


def test_worked_example_reads_two_ranges_per_source():
    """qwen3.5-397b-a17b P2 -> D8, 8192 tokens: ~460 coalesced rows (interleaved; ~750 split) become 2 ranges."""
    from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids

    model = load_preset("qwen3.5-397b-a17b")
    pre = fake_engine(model, 2, None, 64, 0)
    dec = fake_engine(model, 8, None, 128, 1)
    rng = np.random.default_rng(0)
    n = 8192
    remote = make_block_ids(blocks_needed(model, pre[0].block_size, n), 64, 1.0, rng)
    local = make_block_ids(blocks_needed(model, dec[0].block_size, n), 128, 1.0, rng)
    plan = Planner(model, dec[3], pre).plan(local, remote, n, PlanMode.COALESCED)
    (src,) = plan.sources
    layout = stage_layout(RankGeometry(model, 2, src.source_rank), pre[src.source_rank].tensor_addrs, remote, n)
    read = map_rows(layout, src.local_addr, src.remote_addr, src.length)
    assert src.num_descriptors > 400 and read.num_ranges == 2
    assert read.total_bytes == src.total_bytes == 149_836_800
    # The rank stages its one KV head (every consumer of it reads it whole) and its state (split four ways).
    g = RankGeometry(model, 2, src.source_rank)
    assert layout.total_bytes == n * g.kv_bytes_per_token * 15 + g.state_bytes_per_request


def test_tiles_cut_one_tensor_for_all_and_map_like_the_whole():
    """``map_rows(..., tiles)``: the planner's tensor-major rows, shuffled rows and a row moved out of the staged
    bytes in the last tensor give what cutting every row gives (the same ranges, pieces or error)."""
    from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids

    model = load_preset("qwen3.5-397b-a17b")
    pre, dec = fake_engine(model, 2, None, 64, 0), fake_engine(model, 8, None, 128, 1)
    rng = np.random.default_rng(1)
    n = 9000
    remote = make_block_ids(blocks_needed(model, pre[0].block_size, n), 64, 1.0, rng)
    local = make_block_ids(blocks_needed(model, dec[0].block_size, n), 128, 1.0, rng)
    (src,) = Planner(model, dec[5], pre).plan(local, remote, n, PlanMode.COALESCED).sources
    g = RankGeometry(model, 2, src.source_rank)
    layout = stage_layout(g, pre[src.source_rank].tensor_addrs, remote, n)
    perm = rng.permutation(src.length.shape[0])
    for rows in ((src.local_addr, src.remote_addr, src.length),
                 (src.local_addr[perm], src.remote_addr[perm], src.length[perm])):
        whole, tiled = map_rows(layout, *rows), map_rows(layout, *rows, g.num_tensors)
        for name in StagedRead.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(tiled, name), getattr(whole, name), err_msg=name)
    moved = src.remote_addr.copy()
    moved[-200] += g.page_bytes // 2 + 1  # into bytes no atom holds (the ssm page's padding or another head's)
    errors = []
    for tiles in (1, g.num_tensors):
        with pytest.raises(PlanError) as info:
            map_rows(layout, src.local_addr, moved, src.length, tiles)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


def test_rows_outside_the_staged_bytes_are_refused():
    model = load_preset("qwen3.5-0.8b")
    g = RankGeometry(model, 1, 0)
    addrs = [(j + 1) << 40 for j in range(g.num_tensors)]
    layout = stage_layout(g, addrs, [[0, 1], [2], [3], [4]], g.block_size + 1)
    one = np.array([1], dtype=np.int64)
    with pytest.raises(PlanError, match="does not stage"):  # token 1 of the last block: its unused tail
        map_rows(layout, one * 0, one * (addrs[0] + g.kv_offset(1, 0, 0, 0, 1)), one * 16)
    with pytest.raises(PlanError, match="does not stage"):  # state padding
        map_rows(layout, one * 0, one * (addrs[0] + g.page_bytes * 2 + g.state_page_bytes), one * 16)
    with pytest.raises(PlanError, match="same staged bytes"):
        rows = np.repeat(layout.addr[:1], 2)
        map_rows(layout, np.array([0, 1 << 20]), rows, np.array([16, 16]))
    with pytest.raises(PlanError, match="staged nothing"):
        map_rows(stage_layout(g, addrs, [[], [2], [3], [4]], 0), one, one, one)
