"""Every validation error is raised for the input that should raise it, naming the offending values."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.errors import (
    BlockCountError,
    BlockIdError,
    ByteCountError,
    DuplicateBlockError,
    GroupCountError,
    OverlapError,
    PlanError,
    RangeError,
)
from hybrid_transfer.layout import RankGeometry, load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import fake_engine
from hybrid_transfer.plan.types import PlanMode, ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import RegionTable, expected_bytes, validate_plan

MODEL = load_preset("qwen3.5-397b-a17b")  # P2 -> D8: remote block 2096 tokens, local 528; 1 FA + 3 GDN groups
PRODUCERS = fake_engine(MODEL, 2, None, 32, 0)
CONSUMERS = fake_engine(MODEL, 8, None, 64, 1)
N = 3000  # remote: ceil(3000 / 2096) = 2 blocks; local: ceil(3000 / 528) = 6 blocks


def good():
    local = [list(range(6)), [10], [11], [12]]
    remote = [[5, 6], [7], [8], [9]]
    return local, remote


@pytest.fixture(scope="module")
def planner():
    return Planner(MODEL, CONSUMERS[3], PRODUCERS)


def test_good_request_plans(planner):
    local, remote = good()
    plan = planner.plan(local, remote, N)
    assert plan.total_bytes == expected_bytes(planner.local, N)
    local[0] = local[0] + [40, 41]  # extra trailing local blocks are allowed and left alone
    assert planner.plan(local, remote, N).total_bytes == plan.total_bytes


@pytest.mark.parametrize("side", ["local", "remote"])
def test_wrong_group_count(planner, side):
    local, remote = good()
    ids = {"local": local, "remote": remote}
    ids[side].pop()
    with pytest.raises(GroupCountError) as info:
        planner.plan(ids["local"], ids["remote"], N)
    assert (info.value.side, info.value.expected, info.value.actual) == (side, 4, 3)


@pytest.mark.parametrize("side,group,ids,expected,at_least", [
    ("remote", 0, [5], 2, False),
    ("remote", 0, [5, 6, 20], 2, False),  # the producer lists exactly ceil(n / B_remote)
    ("local", 0, [0, 1, 2, 3, 4], 6, True),
    ("local", 2, [11, 13], 1, False),
    ("remote", 3, [], 1, False),
])
def test_wrong_block_count(planner, side, group, ids, expected, at_least):
    local, remote = good()
    {"local": local, "remote": remote}[side][group] = ids
    with pytest.raises(BlockCountError) as info:
        planner.plan(local, remote, N)
    e = info.value
    assert (e.side, e.group, e.expected, e.actual, e.at_least) == (side, group, expected, len(ids), at_least)
    assert str(len(ids)) in str(e)


@pytest.mark.parametrize("side,group,ids,bad,num_blocks", [
    ("local", 0, [0, 1, 2, 3, 64, 5], 64, 64),
    ("local", 1, [-1], -1, 64),
    ("remote", 2, [32], 32, 32),
])
def test_block_id_out_of_range(planner, side, group, ids, bad, num_blocks):
    local, remote = good()
    {"local": local, "remote": remote}[side][group] = ids
    with pytest.raises(BlockIdError) as info:
        planner.plan(local, remote, N)
    assert (info.value.side, info.value.group, info.value.block_id, info.value.num_blocks) == (
        side, group, bad, num_blocks)
    assert str(bad) in str(info.value)


@pytest.mark.parametrize("side,group,ids,dup,groups", [
    ("local", 0, [0, 1, 2, 2, 4, 5], 2, [0, 0]),
    ("local", 1, [3], 3, [0, 1]),
    ("remote", 3, [7], 7, [1, 3]),
])
def test_duplicate_block_ids(planner, side, group, ids, dup, groups):
    local, remote = good()
    {"local": local, "remote": remote}[side][group] = ids
    with pytest.raises(DuplicateBlockError) as info:
        planner.plan(local, remote, N)
    assert (info.value.side, info.value.block_id, list(info.value.groups)) == (side, dup, groups)


def test_non_integer_ids_and_negative_tokens(planner):
    local, remote = good()
    local[1] = [1.5]
    with pytest.raises(PlanError):
        planner.plan(local, remote, N)
    with pytest.raises(PlanError):
        planner.plan(*good(), -1)


# ---- plan-level checks (the planner's own output is not trusted) ----------------------------------------

def tables(planner):
    remote = {t.source_rank: RegionTable(PRODUCERS[t.source_rank].tensor_addrs, PRODUCERS[0].region_bytes)
              for t in planner.templates}
    return RegionTable(CONSUMERS[3].tensor_addrs, CONSUMERS[3].region_bytes), remote


def tampered(plan: ReadPlan, **columns) -> ReadPlan:
    src = plan.sources[0]
    new = dataclasses.replace(src, **{k: v(getattr(src, k).copy()) for k, v in columns.items()})
    return dataclasses.replace(plan, sources=(new,))


def bump(i, by):
    def f(a):
        a[i] += by
        return a
    return f


def test_range_outside_a_region(planner):
    plan = planner.plan(*good(), N)
    local_t, remote_t = tables(planner)
    validate_plan(plan, local_t, remote_t)
    end = CONSUMERS[3].tensor_addrs[0] + CONSUMERS[3].region_bytes
    with pytest.raises(RangeError) as info:
        validate_plan(tampered(plan, local_addr=lambda a: np.where(a == a.max(), end - 1, a)), local_t, remote_t)
    assert info.value.side == "local" and info.value.addr == end - 1
    with pytest.raises(RangeError) as info:
        validate_plan(tampered(plan, remote_addr=bump(0, -(1 << 40))), local_t, remote_t)
    assert info.value.side.startswith("remote rank")


def test_overlapping_destinations(planner):
    plan = planner.plan(*good(), N)
    local_t, remote_t = tables(planner)
    src = plan.sources[0]
    second = int(np.argsort(src.local_addr)[1])
    first = int(np.argsort(src.local_addr)[0])
    bad = tampered(plan, local_addr=bump(second, int(src.local_addr[first] - src.local_addr[second] + 1)))
    with pytest.raises(OverlapError) as info:
        validate_plan(bad, local_t, remote_t)
    assert info.value.first[0] == src.local_addr[first]


def test_byte_count_mismatch(planner):
    plan = planner.plan(*good(), N)
    local_t, remote_t = tables(planner)
    with pytest.raises(ByteCountError) as info:
        validate_plan(tampered(plan, length=bump(0, -1)), local_t, remote_t)
    assert info.value.expected_bytes == plan.expected_bytes
    assert info.value.local_bytes == plan.expected_bytes - 1
    with pytest.raises(ByteCountError):
        validate_plan(dataclasses.replace(plan, expected_bytes=plan.expected_bytes + 1), local_t, remote_t)


def test_zero_length_rows_and_unknown_sources_are_refused(planner):
    plan = planner.plan(*good(), N)
    local_t, remote_t = tables(planner)
    with pytest.raises(RangeError):
        validate_plan(tampered(plan, length=lambda a: np.where(np.arange(a.shape[0]) == 0, 0, a)),
                      local_t, remote_t)
    stranger = dataclasses.replace(plan, sources=(SourcePlan(5, *(c for c in (
        plan.sources[0].local_addr, plan.sources[0].remote_addr, plan.sources[0].length))),))
    with pytest.raises(PlanError):
        validate_plan(stranger, local_t, remote_t)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_expected_bytes_matches_design_figures(tp):
    g = RankGeometry(MODEL, tp)
    # docs/presets.md#check-numbers: 30,720 B per token over 15 FA layers at TP1, 15,360 B at TP >= 2 (replicated heads count once).
    per_token = 30_720 if tp == 1 else 15_360
    state = {1: 183.16, 2: 91.58, 4: 45.79, 8: 22.90}[tp]
    assert expected_bytes(g, 1) - expected_bytes(g, 0) - g.state_bytes_per_request == per_token
    assert round(g.state_bytes_per_request / 2**20, 2) == state
    assert expected_bytes(g, 0) == 0


def test_planner_expected_bytes_agrees_with_independent_figure(planner):
    for n in (0, 1, 527, 528, 8192):
        assert planner.expected_bytes(n) == expected_bytes(planner.local, n)
    assert planner.plan(*good(), N, PlanMode.COALESCED).expected_bytes == expected_bytes(planner.local, N)
    # Naive moves whole pages (vLLM's scheme): the plan's bytes are the page-rounded figure.
    end = min(-(-N // planner.local.block_size) * planner.local.block_size,
              -(-N // planner.remote.block_size) * planner.remote.block_size)
    assert planner.plan(*good(), N, PlanMode.NAIVE).expected_bytes == expected_bytes(planner.local, end)


# ---- equal fields: every dtype, from real caches through describe_cache (issue 19, row 8) ----------------


def _tiny_descriptor(tp_size: int, tp_rank: int, **options):
    from tiny_model import TINY_CONFIG

    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.layout import CacheOptions, model_from_config
    from hybrid_transfer.planner_input import describe_cache

    model = model_from_config(TINY_CONFIG, name="tiny")
    cache = HybridCache.allocate(RankGeometry(model, tp_size, tp_rank, CacheOptions(**options)), 8)
    return model, describe_cache(cache)


@pytest.mark.parametrize(("field", "ours", "theirs"), [
    ("conv_dtype", "bfloat16", "float32"),
    ("conv_dtype", None, "float32"),  # "" on the wire (the model dtype) against an override
    ("ssm_dtype", "float32", "bfloat16"),
    ("kv_dtype", "bfloat16", "float16"),
])
def test_a_peer_whose_dtype_differs_is_refused_naming_the_field(field, ours, theirs):
    from hybrid_transfer.errors import FingerprintMismatch

    model, local = _tiny_descriptor(1, 0, **({field: ours} if ours else {}))
    _, remote = _tiny_descriptor(1, 0, **{field: theirs})
    with pytest.raises(FingerprintMismatch) as info:
        Planner(model, local, [remote])
    assert [d[0] for d in info.value.differences] == [field] and field in str(info.value)
    assert info.value.differences[0][2] == theirs


def test_a_dtype_left_to_the_model_equals_the_same_dtype_named():
    model, local = _tiny_descriptor(1, 0)
    _, remote = _tiny_descriptor(1, 0, conv_dtype=model.dtype.value)
    assert local.conv_dtype == "" or local.conv_dtype == remote.conv_dtype
    Planner(model, local, [remote])  # the resolved dtypes are equal: no refusal


def test_a_range_below_the_lowest_region_is_refused():
    """The sentinel below the lowest region holds nothing (``ends[idx] - addr`` wrapped there and let it pass)."""
    table = RegionTable([1000, 5000], 100)
    addr = np.array([1, 990, 1000, 1050, 4000, 5099], dtype=np.int64)
    length = np.array([10, 20, 100, 100, 10, 1], dtype=np.int64)
    np.testing.assert_array_equal(table.contains(addr, length), [False, False, True, False, False, True])
    with pytest.raises(RangeError) as info:
        table.check("local", addr[:1], length[:1])
    assert (info.value.addr, info.value.length) == (1, 10)
    assert not table.holds(addr[:1], addr[:1] + length[:1])
    assert not table.holds_ascending(addr[:1], addr[:1] + length[:1])


def _oracle(starts, lens, addr, length) -> bool:
    """Every range non-empty and inside one region, region by region in Python."""
    return all(n > 0 and any(s <= a and a + n <= s + ln for s, ln in zip(starts, lens, strict=True))
               for a, n in zip(addr, length, strict=True))


@settings(max_examples=300, deadline=None)
@given(regions=st.lists(st.tuples(st.integers(0, 6), st.integers(1, 12)), min_size=1, max_size=6),
       rows=st.lists(st.tuples(st.integers(-5, 80), st.integers(-1, 14)), min_size=1, max_size=24),
       tensor_major=st.booleans(), order=st.randoms(use_true_random=False))
def test_holds_and_holds_ascending_agree_with_contains_and_an_oracle(regions, rows, tensor_major, order):
    """``holds`` (equal runs, then per row) and ``holds_ascending`` (per region) answer ``contains(...).all()``.

    Regions are disjoint, as registered memory is, and listed in any order."""
    starts, lens, end = [], [], 0
    for gap, n in regions:
        starts.append(end + gap * 8)
        lens.append(n * 8)
        end = starts[-1] + lens[-1]
    pairs = list(zip(starts, lens, strict=True))
    order.shuffle(pairs)
    starts, lens = [s for s, _ in pairs], [n for _, n in pairs]
    table = RegionTable(starts, lens)
    addr = np.array([a * 4 for a, _ in rows], dtype=np.int64)
    length = np.array([n * 4 for _, n in rows], dtype=np.int64)
    if tensor_major:  # one run per region, each run's rows inside it but for what the draw moves out
        k = len(regions)
        addr = np.repeat(np.array(starts, dtype=np.int64), len(rows)) + np.tile(addr, k)
        length = np.tile(length, k)
    want = _oracle(starts, lens, addr.tolist(), length.tolist())
    assert bool(table.contains(addr, length).all()) == want
    assert table.holds(addr, addr + length) == want
    order = np.argsort(addr, kind="stable")
    a, e = addr[order], (addr + length)[order]
    if (e > a).all() and (a[1:] >= e[:-1]).all():  # holds_ascending's precondition
        assert table.holds_ascending(a, e) == want


def test_rows_in_any_order_are_checked_alike(planner):
    """The fast checks assume no order: shuffled rows pass, and a range moved out is refused in any order."""
    plan = planner.plan(*good(), N)
    local_t, remote_t = tables(planner)
    src = plan.sources[0]
    perm = np.random.default_rng(3).permutation(src.length.shape[0])
    shuffled = dataclasses.replace(plan, sources=(SourcePlan(src.source_rank, src.local_addr[perm],
                                                             src.remote_addr[perm], src.length[perm]),))
    validate_plan(shuffled, local_t, remote_t)
    low = int(local_t.starts[1]) // 2  # below the lowest local region, still positive
    with pytest.raises(RangeError) as info:
        validate_plan(tampered(shuffled, local_addr=lambda a: np.where(a == a.max(), low, a)), local_t, remote_t)
    assert info.value.addr == low
    with pytest.raises(RangeError) as info:
        top = int(remote_t[src.source_rank].ends.max())  # just past the highest remote region
        validate_plan(tampered(shuffled, remote_addr=lambda a: np.where(np.arange(a.shape[0]) == 3, top, a)),
                      local_t, remote_t)
    assert info.value.side.startswith("remote rank")
