"""Planner: docs/planner.md formulas and worked example, modes, notifications, pack plans, construction checks."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from hybrid_transfer.errors import FingerprintMismatch, PlanError, TopologyError
from hybrid_transfer.layout import (
    CacheOptions,
    DType,
    KVLayout,
    LayerKind,
    RankGeometry,
    load_preset,
    model_from_config,
)
from hybrid_transfer.plan.pack import PackRecipe
from hybrid_transfer.plan.pieces import last_cut, naive_token_end
from hybrid_transfer.plan.planner import Planner, to_pack
from hybrid_transfer.plan.rank import RankDescriptor
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.stage_layout import StagedRead
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode, ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import expected_bytes

Q397 = "qwen3.5-397b-a17b"


SPLIT, INTERLEAVED = KVLayout.SPLIT, KVLayout.INTERLEAVED


def with_layout(options: CacheOptions | None, layout: KVLayout | None) -> CacheOptions | None:
    if layout is None:
        return options
    return msgspec.structs.replace(options or CacheOptions(), kv_layout=layout)


def engines(model, p, d, prefill=None, decode=None, pool=64, layout=None):
    return (fake_engine(model, p, with_layout(prefill, layout), pool, 0),
            fake_engine(model, d, with_layout(decode, layout), pool, 1))


def request_ids(model, producers, consumers, n, fragmentation, seed=0):
    rng = np.random.default_rng(seed)
    remote = make_block_ids(blocks_needed(model, producers[0].block_size, n), producers[0].num_blocks,
                            fragmentation, rng)
    local = make_block_ids(blocks_needed(model, consumers[0].block_size, n), consumers[0].num_blocks,
                           fragmentation, rng)
    return local, remote


def rows(plan_source: SourcePlan) -> set[tuple[int, int, int]]:
    return set(zip(plan_source.local_addr.tolist(), plan_source.remote_addr.tolist(), plan_source.length.tolist(),
                   strict=True))


# ---- docs/planner.md#worked-example --------------------------------------------------------------------------

@pytest.mark.parametrize(("layout", "kv_per_tensor", "total"), [(SPLIT, 19 * 2, 750), (INTERLEAVED, 19, 465)])
def test_worked_example_p2_d8_fragmented(layout, kv_per_tensor, total):
    """qwen3.5-397b-a17b, 8192 tokens, P2 -> D8 fragmented: 19 token ranges per FA layer (per half in split).

    Split: 570 KV + 180 state pieces. Interleaved: a head's range holds K and V, so 285 KV pieces of twice
    the length, the same 180 state pieces and the same 149,836,800 bytes.
    """
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8, layout=layout)
    assert (producers[0].block_size, consumers[0].block_size) == (2096, 528)
    local, remote = request_ids(model, producers, consumers, 8192, 1.0)
    whole = 270_336 * (2 if layout is INTERLEAVED else 1)  # 528 tokens x 512 B (x 2 for K|V)
    unit = 512 * (2 if layout is INTERLEAVED else 1)
    for d in range(8):
        plan = Planner(model, consumers[d], producers).plan(local, remote, 8192, PlanMode.COALESCED)
        assert plan.total_bytes == plan.expected_bytes == 149_836_800
        (src,) = plan.sources
        assert src.source_rank == d // 4
        off = src.local_addr - consumers[d].tensor_addrs[0]
        in_tensor0 = (off >= 0) & (off < consumers[d].region_bytes)
        block = off[in_tensor0] // consumers[d].page_bytes
        is_kv = np.isin(block, local[0])
        kv_len = src.length[in_tensor0][is_kv]
        assert kv_len.shape[0] == kv_per_tensor  # one tensor holds one FA layer
        assert np.count_nonzero(kv_len == whole) >= kv_per_tensor // 19 * 12
        assert set(kv_len[kv_len != whole].tolist()) <= {t * unit for t in range(1, 529)}
        assert sorted(set(src.length[in_tensor0][~is_kv].tolist())) == [1536, 6144, 524_288]
        assert src.num_descriptors == total
        addrs = np.asarray(consumers[d].tensor_addrs)
        tensor = np.searchsorted(addrs, src.local_addr, side="right") - 1
        all_kv = np.isin((src.local_addr - addrs[tensor]) // consumers[d].page_bytes, local[0])
        assert np.count_nonzero(~all_kv) == 180 and np.count_nonzero(all_kv) == 15 * kv_per_tensor
        assert plan.notify[0].source_rank == d // 4 and plan.notify[0].expected_consumers == 4


@pytest.mark.parametrize(("layout", "coalesced_per_tensor", "naive_kv_per_tensor"), [(SPLIT, 7, 8), (INTERLEAVED, 5, 4)])
def test_p1_d1_contiguous_coalesces_whole_blocks_and_conv_with_ssm(layout, coalesced_per_tensor, naive_kv_per_tensor):
    model = load_preset(Q397)
    producers, consumers = engines(model, 1, 1, layout=layout)
    local, remote = request_ids(model, producers, consumers, 8192, 0.0)
    planner = Planner(model, consumers[0], producers)
    naive = planner.plan(local, remote, 8192, PlanMode.NAIVE)
    coalesced = planner.plan(local, remote, 8192, PlanMode.COALESCED)
    # Per tensor, split: blocks 0-2 and block 3's first K head merge into one range, 3 more for the partial
    # block; interleaved: blocks 0-2 and block 3's first head (K|V) merge, 1 more for its second head.
    # Then one conv|ssm range per GDN group (equal TP). Naive, vLLM's scheme: one descriptor per kernel page
    # (per half in split), whole pages, and conv Q, K, V, ssm per GDN layer.
    assert coalesced.num_descriptors == 15 * coalesced_per_tensor
    assert naive.num_descriptors == 15 * (naive_kv_per_tensor + 3 * 4)
    assert coalesced.total_bytes == expected_bytes(planner.local, 8192)
    assert naive.total_bytes == naive.expected_bytes == expected_bytes(planner.local, 4 * 2096)  # 4 whole pages


@pytest.mark.parametrize("layout", list(KVLayout))
def test_naive_is_vllm_count_for_qwen35_08b(layout):
    """vLLM 0.33's count with equal TP and block sizes: R * K_fa + G_gdn * R * 4 = 6*4 + 3*6*4 = 96 (interleaved)."""
    model = load_preset("qwen3.5-0.8b")
    producers, consumers = engines(model, 1, 1, layout=layout)
    assert consumers[0].block_size == 544 and consumers[0].kernel_block_size == 544
    local, remote = request_ids(model, producers, consumers, 2047, 1.0)
    planner = Planner(model, consumers[0], producers)
    plan = planner.plan(local, remote, 2047, PlanMode.NAIVE)
    halves = 2 if layout is SPLIT else 1
    assert plan.num_descriptors == 6 * 4 * halves + 3 * 6 * 4
    assert plan.num_descriptors == (96 if layout is INTERLEAVED else 120)
    assert plan.total_bytes == expected_bytes(planner.local, 4 * 544)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("p,d", [(1, 2), (2, 8), (4, 1), (8, 2), (2, 2)])
def test_naive_is_one_read_per_source_and_one_descriptor_per_slot_and_page_pair(layout, p, d):
    """Hetero TP: per source, one FA descriptor per (slot, source kernel page, destination kernel page)."""
    model = load_preset(Q397)
    producers, consumers = engines(model, p, d, layout=layout)
    n = 5000
    local, remote = request_ids(model, producers, consumers, n, 1.0)
    bp, bd = producers[0].block_size, consumers[0].block_size
    end = min(-(-n // bp) * bp, -(-n // bd) * bd)
    pairs = len(set(range(0, end, bp)) | set(range(0, end, bd)))  # page pairs = segments cut at both sides' pages
    for rank in sorted({0, d - 1}):
        planner = Planner(model, consumers[rank], producers)
        assert naive_token_end(n, planner.local, planner.remote) == end
        plan = planner.plan(local, remote, n, PlanMode.NAIVE)
        kv_sources = [t for t in planner.templates if not t.kv.is_empty]
        halves = 2 if layout is SPLIT else 1
        # Whole kernel pages on both sides (or one head): the heads taken from a page are one range (per half).
        want_kv = len(kv_sources) * 15 * pairs * halves
        want_state = len(planner.templates) * 45 * 4
        assert plan.num_descriptors == want_kv + want_state
        assert plan.total_bytes == expected_bytes(planner.local, end)


# ---- formulas -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,p,d", [(Q397, 2, 8), (Q397, 1, 4), ("qwen3.5-27b", 2, 4), ("qwen3.5-4b", 1, 2)])
def test_fan_out_state_is_the_three_read_conv_and_an_ssm_slice(preset, p, d):
    """docs/planner.md#conv-3-read: Q at o*s0, K at r*s0 + o*s1, V at r*s0 + r*s1 + o*s2, ssm at remote_conv + o*local_ssm."""
    model = load_preset(preset)
    producers, consumers = engines(model, p, d)
    local, remote = request_ids(model, producers, consumers, 100, 1.0, seed=3)
    gdn = [i for i, k in enumerate(Planner(model, consumers[0], producers)._kinds) if k is LayerKind.GDN]
    r = d // p
    for rank in range(d):
        planner = Planner(model, consumers[rank], producers)
        s0, s1, s2 = planner.local.conv_segment_bytes
        o = rank % r
        (src,) = planner.plan(local, remote, 100, PlanMode.NAIVE).sources
        got = rows(src)
        want_rel = [(0, o * s0, s0), (s0, r * s0 + o * s1, s1), (s0 + s1, r * s0 + r * s1 + o * s2, s2),
                    (planner.local.conv_bytes, planner.remote.conv_bytes + o * planner.local.ssm_bytes,
                     planner.local.ssm_bytes)]
        for g in gdn:
            for j in range(planner.local.num_tensors):
                lbase = consumers[rank].tensor_addrs[j] + local[g][0] * consumers[rank].page_bytes
                rbase = producers[rank // r].tensor_addrs[j] + remote[g][0] * producers[0].page_bytes
                for lo, ro, n in want_rel:
                    assert (lbase + lo, rbase + ro, n) in got


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("p,d,bs_p,kb_p,bs_d,kb_d", [(2, 4, 48, 16, 40, 8), (1, 4, 64, 64, 24, 8),
                                                     (2, 8, 32, 8, 48, 48)])
def test_kv_pieces_follow_the_design_formula_with_different_block_sizes(p, d, bs_p, kb_p, bs_d, kb_d, layout):
    """One local head, per token segment: split reads K and V of the head apart, interleaved as one range.

    Split: remote offset ``half * half_bytes + (head - first_head(src)) * B_s * hd * b + t0 * hd * b`` in the
    remote kernel block; interleaved: ``((head - first_head(src)) * B_s + t0) * 2 * hd * b``, twice the length.
    Naive moves up to the end of the last page both sides hold.
    """
    model = load_preset("qwen3.5-27b")  # K = 4: unreplicated at TP <= 4, replicated at TP 8
    prefill = CacheOptions(block_size=bs_p * 64, kernel_block_size=kb_p, kv_layout=layout)
    decode = CacheOptions(block_size=bs_d * 64, kernel_block_size=kb_d, kv_layout=layout)
    producers, consumers = engines(model, p, d, prefill, decode)
    n = 1000
    local, remote = request_ids(model, producers, consumers, n, 1.0, seed=5)
    split = layout is SPLIT
    for rank in range(d):
        planner = Planner(model, consumers[rank], producers)
        lg, rg = planner.local, planner.remote
        src_rank = rank // (d // p)
        src_geo = RankGeometry(model, p, src_rank, prefill)
        (src,) = planner.plan(local, remote, n, PlanMode.NAIVE).sources
        got = rows(src)
        htb = model.head_dim * 2
        tok = htb if split else 2 * htb
        end = min(-(-n // lg.block_size) * lg.block_size, -(-n // rg.block_size) * rg.block_size)
        cuts = sorted({0, end} | set(range(lg.kernel_block_size, end, lg.kernel_block_size))
                      | set(range(rg.kernel_block_size, end, rg.kernel_block_size)))
        want = set()
        for t0, t1 in zip(cuts[:-1], cuts[1:], strict=True):
            lb, lt = divmod(t0, lg.block_size)
            rb, rt = divmod(t0, rg.block_size)
            for half in ((0, 1) if split else (0,)):
                for slot, head in enumerate(lg.kv_heads):
                    lo = (local[0][lb] * lg.page_bytes + (lt // lg.kernel_block_size) * lg.kernel_block_bytes
                          + (half * lg.kernel_block_bytes // 2 if split else 0)
                          + slot * lg.kernel_block_size * tok + (lt % lg.kernel_block_size) * tok)
                    ro = (remote[0][rb] * rg.page_bytes + (rt // rg.kernel_block_size) * rg.kernel_block_bytes
                          + (half * rg.kernel_block_bytes // 2 if split else 0)
                          + (head - src_geo.first_kv_head) * rg.kernel_block_size * tok
                          + (rt % rg.kernel_block_size) * tok)
                    for j in range(lg.num_tensors):
                        want.add((consumers[rank].tensor_addrs[j] + lo, producers[src_rank].tensor_addrs[j] + ro,
                                  (t1 - t0) * tok))
        # One local head (D >= K): naive merges nothing, so the KV rows are exactly the formula's.
        assert want <= got
        assert len(got) - len(want) == 4 * 3 * lg.num_tensors  # the rest: Q, K, V, ssm per GDN group


def test_fan_in_state_reads_each_source_into_its_chunk():
    model = load_preset(Q397)
    producers, consumers = engines(model, 8, 2)
    local, remote = request_ids(model, producers, consumers, 10, 1.0)
    planner = Planner(model, consumers[1], producers)
    plan = planner.plan(local, remote, 10, PlanMode.NAIVE)
    g = 1  # first GDN group
    s0, s1, s2 = planner.remote.conv_segment_bytes
    a = 4
    for i, src in enumerate(plan.sources):
        assert src.source_rank == 4 + i
        lbase = consumers[1].tensor_addrs[0] + local[g][0] * consumers[1].page_bytes
        rbase = producers[4 + i].tensor_addrs[0] + remote[g][0] * producers[0].page_bytes
        got = rows(src)
        for lo, ro, n in [(i * s0, 0, s0), (a * s0 + i * s1, s0, s1), (a * (s0 + s1) + i * s2, s0 + s1, s2),
                          (planner.local.conv_bytes + i * planner.remote.ssm_bytes, planner.remote.conv_bytes,
                           planner.remote.ssm_bytes)]:
            assert (lbase + lo, rbase + ro, n) in got


def test_fan_in_reads_kv_only_from_sources_with_distinct_heads():
    """K=2, P=4, D=1: KV from ranks 0 and 2; ranks 1 and 3 only give state."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 4, 1)
    local, remote = request_ids(model, producers, consumers, 64, 0.0)
    planner = Planner(model, consumers[0], producers)
    assert [t.kv.is_empty for t in planner.templates] == [False, True, False, True]
    plan = planner.plan(local, remote, 64, PlanMode.COALESCED)
    by_rank = {s.source_rank: s.total_bytes for s in plan.sources}
    state = planner.remote.state_bytes_per_request
    assert by_rank[1] == by_rank[3] == state
    assert by_rank[0] == by_rank[2] == state + 64 * 15 * 1024
    assert [n.source_rank for n in plan.notify] == [0, 1, 2, 3]


ATTN_ONLY = {"num_hidden_layers": 4, "layer_types": ["full_attention"] * 4, "num_key_value_heads": 2,
             "head_dim": 8, "dtype": "bfloat16"}


def test_attention_only_fan_in_notifies_sources_it_does_not_read():
    model = model_from_config(ATTN_ONLY, name="attn-only")
    opts = CacheOptions(block_size=16)
    producers, consumers = engines(model, 4, 1, opts, opts)
    local, remote = request_ids(model, producers, consumers, 40, 0.0)
    plan = Planner(model, consumers[0], producers).plan(local, remote, 40)
    assert [s.source_rank for s in plan.sources] == [0, 2]
    assert [(n.source_rank, n.expected_consumers) for n in plan.notify] == [(0, 1), (1, 1), (2, 1), (3, 1)]


def test_zero_tokens_moves_nothing_but_still_notifies():
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8)
    gdn = [[i] for i in range(3)]
    plan = Planner(model, consumers[5], producers).plan([[]] + gdn, [[]] + [[10 + i] for i in range(3)], 0)
    assert plan.sources == () and plan.total_bytes == plan.expected_bytes == 0
    assert [(n.source_rank, n.expected_consumers) for n in plan.notify] == [(1, 4)]


# ---- modes ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("preset", ["qwen3-next-80b-a3b", Q397, "qwen3.5-27b", "qwen3.5-0.8b"])
@pytest.mark.parametrize("p,d", [(1, 1), (1, 8), (8, 1), (2, 4), (4, 2), (8, 8)])
@pytest.mark.parametrize("fragmentation", [0.0, 1.0])
def test_coalesced_moves_valid_bytes_and_naive_whole_pages(preset, p, d, fragmentation, layout):
    """Naive moves the page-rounded bytes, coalesced the valid ones; coalesced only beats naive's count
    by cutting the partial last page per head (naive copies it whole)."""
    model = load_preset(preset)
    producers, consumers = engines(model, p, d, pool=128, layout=layout)
    local, remote = request_ids(model, producers, consumers, 5000, fragmentation)
    for rank in sorted({0, d - 1}):
        planner = Planner(model, consumers[rank], producers)
        naive = planner.plan(local, remote, 5000, PlanMode.NAIVE)
        coalesced = planner.plan(local, remote, 5000, PlanMode.COALESCED)
        end = naive_token_end(5000, planner.local, planner.remote)
        assert coalesced.total_bytes == expected_bytes(planner.local, 5000)
        assert naive.total_bytes == expected_bytes(planner.local, end)
        halves = 2 if layout is SPLIT else 1
        slack = len(model.attention_layers) * planner.local.num_kv_heads_local * halves
        assert coalesced.num_descriptors <= naive.num_descriptors + slack
        assert [s.source_rank for s in naive.sources] == [s.source_rank for s in coalesced.sources]


def test_coalesced_rows_ascend_within_each_tensor():
    model = load_preset(Q397)
    producers, consumers = engines(model, 1, 1)
    local, remote = request_ids(model, producers, consumers, 7000, 0.0)
    (src,) = Planner(model, consumers[0], producers).plan(local, remote, 7000).sources
    per_tensor = src.local_addr.reshape(15, -1)
    assert np.all(np.diff(per_tensor, axis=1) > 0)
    assert np.all(np.diff(src.remote_addr.reshape(15, -1), axis=1) > 0)  # contiguous ids: ascending on both sides


def test_pack_plan_reads_ranges_of_the_sources_canonical_staging():
    """Fan-in 8 -> 2, fragmented: at most two ranges per source, the coalesced rows kept for a direct fallback."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 8, 2)
    local, remote = request_ids(model, producers, consumers, 3000, 1.0)
    planner = Planner(model, consumers[0], producers)
    direct = planner.plan(local, remote, 3000, PlanMode.COALESCED)
    pack = planner.plan(local, remote, 3000, PlanMode.PACK)
    assert len(pack.sources) == 4 and pack.num_descriptors <= 8 < direct.num_descriptors
    for d_src, p_src in zip(direct.sources, pack.sources, strict=True):
        assert isinstance(p_src, PackSourcePlan)
        assert rows(p_src.direct) == rows(d_src)
        # Replicated KV heads are read from one source only: a source may stage more than this rank reads.
        assert p_src.total_bytes == d_src.total_bytes <= p_src.staged_bytes
        assert p_src.read.scatter_length.sum() == d_src.total_bytes
        assert np.all(np.diff(p_src.read.scatter_src) > 0)


def test_consumer_ranks_read_ranges_that_cover_the_producers_staging():
    """Fan-out 2 -> 8: the producer gathers once in its own order; its four readers' ranges cover it
    (KV heads are replicated on the decode side, so readers share the KV range; state shares are disjoint)."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8)
    local, remote = request_ids(model, producers, consumers, 3000, 1.0)
    for source in (0, 1):
        ranges, layouts = [], []
        for d in range(8):
            for src in Planner(model, consumers[d], producers).plan(local, remote, 3000, PlanMode.PACK).sources:
                if src.source_rank == source:
                    assert src.num_descriptors <= 2
                    layouts.append(src.layout)
                    ranges += zip(src.read.remote_offset.tolist(), src.read.length.tolist(), strict=True)
        assert len(layouts) == 4
        assert all(np.array_equal(lay.addr, layouts[0].addr) for lay in layouts)  # one gather, whoever reads
        ranges.sort()
        end = 0
        for a, n in ranges:
            assert a <= end  # no staged byte left unread
            end = max(end, a + n)
        assert end == layouts[0].total_bytes


def test_auto_picks_pack_for_many_small_descriptors_and_direct_for_few():
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8)
    local, remote = request_ids(model, producers, consumers, 8192, 1.0)
    plan = Planner(model, consumers[0], producers).plan(local, remote, 8192, PlanMode.AUTO)
    assert isinstance(plan.sources[0], PackSourcePlan) and plan.meta["source_modes"] == {0: "pack"}
    from hybrid_transfer.plan.cost import CostModel

    cheap = CostModel(per_descriptor_s=1e-9)
    plan = Planner(model, consumers[0], producers, cost=cheap).plan(local, remote, 8192, PlanMode.AUTO)
    assert isinstance(plan.sources[0], SourcePlan) and plan.meta["source_modes"] == {0: "coalesced"}


# ---- construction checks ----------------------------------------------------------------------------------

def test_remote_list_must_be_every_rank_of_one_engine_in_order():
    model = load_preset(Q397)
    producers, consumers = engines(model, 4, 2)
    with pytest.raises(TopologyError):
        Planner(model, consumers[0], producers[::-1])
    with pytest.raises(TopologyError):
        Planner(model, consumers[0], producers[:2])
    with pytest.raises(TopologyError):
        Planner(model, consumers[0], [])


def test_unmappable_tp_sizes_raise_topology_error():
    cfg = dict(ATTN_ONLY, num_key_value_heads=6)
    model = model_from_config(cfg, name="six-heads")
    opts = CacheOptions(block_size=16)
    producers, consumers = engines(model, 2, 3, opts, opts)
    with pytest.raises(TopologyError) as info:
        Planner(model, consumers[0], producers)
    assert (info.value.prefill_tp, info.value.decode_tp) == (2, 3)


def test_layout_fields_that_must_be_equal_are_checked():
    model = load_preset(Q397)
    producers = fake_engine(model, 2, CacheOptions(kv_dtype=DType.FP8), 16, 0)
    consumers = fake_engine(model, 2, None, 16, 1)
    with pytest.raises(FingerprintMismatch) as info:
        Planner(model, consumers[0], producers)
    assert info.value.differences[0][0] == "kv_dtype"
    producers = fake_engine(model, 2, CacheOptions(kv_layout=SPLIT), 16, 0)
    with pytest.raises(FingerprintMismatch) as info:
        Planner(model, consumers[0], producers)
    assert list(info.value.differences) == [("kv_layout", "interleaved", "split")]


def test_descriptor_that_disagrees_with_its_geometry_is_refused():
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 2)
    fields = {f: getattr(producers[1], f) for f in RankDescriptor.__struct_fields__}
    fields["page_bytes"] += 2
    with pytest.raises(PlanError):
        Planner(model, consumers[0], [producers[0], RankDescriptor(**fields)])


# ---- per-shape recipes (docs/planner.md#per-request-cost) ---------------------------------------------------

def _same_plan(a, b) -> None:
    assert [s.source_rank for s in a.sources] == [s.source_rank for s in b.sources]
    for x, y in zip(a.sources, b.sources, strict=True):
        for col in ("local_addr", "remote_addr", "length"):
            np.testing.assert_array_equal(getattr(x, col), getattr(y, col))


@pytest.mark.parametrize("mode", [PlanMode.NAIVE, PlanMode.COALESCED])
def test_a_planner_reused_across_shapes_plans_as_a_fresh_one(mode):
    """The recipe cache is keyed by the shape: extra local blocks, other token counts and other requests of
    one shape never reuse another shape's positions."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8, pool=256)
    reused = Planner(model, consumers[3], producers)
    shapes = []
    for seed, n in enumerate((5000, 5000, 3000, 8192, 5000)):
        local, remote = request_ids(model, producers, consumers, n, 1.0, seed=seed)
        if seed == 1:  # the consumer holds two blocks more than it needs in the attention group
            spare = sorted(set(range(consumers[0].num_blocks)) - {b for g in local for b in g})[:2]
            local = [list(local[0]) + spare] + [list(g) for g in local[1:]]
        shapes.append((local, remote, n))
    for local, remote, n in shapes + shapes[::-1]:
        _same_plan(reused.plan(local, remote, n, mode), Planner(model, consumers[3], producers).plan(
            local, remote, n, mode))


def _same_pack(a, b) -> None:
    assert [type(s) for s in a.sources] == [type(s) for s in b.sources]
    assert all(isinstance(s, PackSourcePlan) for s in a.sources)
    for x, y in zip(a.sources, b.sources, strict=True):
        assert x.source_rank == y.source_rank
        _same_plan(ReadPlan(0, PlanMode.PACK, (x.direct,), (), 0, 0), ReadPlan(0, PlanMode.PACK, (y.direct,), (), 0, 0))
        for name in ("addr", "length", "offset"):
            np.testing.assert_array_equal(getattr(x.layout, name), getattr(y.layout, name), err_msg=name)
        for name in StagedRead.__dataclass_fields__:
            np.testing.assert_array_equal(getattr(x.read, name), getattr(y.read, name), err_msg=name)


@pytest.mark.parametrize("layout", [SPLIT, INTERLEAVED])
@pytest.mark.parametrize(("p", "d"), [(2, 8), (1, 1), (8, 2)])
def test_a_reused_planners_pack_plans_equal_a_fresh_ones_and_the_reference(layout, p, d):
    """The pack recipe cache (per shape and source, built at a shape's second request) gives, for every shape
    and id draw, what a fresh planner gives and what mapping the direct rows onto the source's staging gives
    (``to_pack``, which a shape's first request uses)."""
    model = load_preset(Q397)
    producers, consumers = engines(model, p, d, pool=256, layout=layout)
    rank = d - 1
    reused = Planner(model, consumers[rank], producers)
    requests = []
    for seed, (n, frag) in enumerate(((5000, 1.0), (5000, 0.0), (3000, 1.0), (8192, 0.5), (5000, 1.0), (1, 0.0),
                                      (17, 1.0))):
        local, remote = request_ids(model, producers, consumers, n, frag, seed=seed)
        if seed == 4:  # the consumer holds two blocks more than it needs in the attention group
            spare = sorted(set(range(consumers[0].num_blocks)) - {b for g in local for b in g})[:2]
            local = [list(local[0]) + spare] + [list(g) for g in local[1:]]
        requests.append((local, remote, n))
    for local, remote, n in requests + requests[::-1]:
        got = reused.plan(local, remote, n, PlanMode.PACK)
        fresh = Planner(model, consumers[rank], producers)
        _same_pack(got, fresh.plan(local, remote, n, PlanMode.PACK))
        remote_ids = [np.asarray(g, dtype=np.int64) for g in remote]
        tpl = {t.source_rank: t for t in fresh.templates}
        ref = tuple(to_pack(s.direct, tpl[s.source_rank], remote_ids, n) for s in got.sources)
        _same_pack(got, ReadPlan(got.decode_rank, PlanMode.PACK, ref, got.notify, n, got.expected_bytes))
        assert got.meta == fresh.plan(local, remote, n, PlanMode.PACK).meta
    shapes = {(n, tuple(map(len, local)), tuple(map(len, remote))) for local, remote, n in requests}
    assert len(shapes) == 6
    # Every structure's second and later plans came from its recipe, one per source read: 1 and 17 tokens share
    # one (the same last cut and list lengths), and every structure here follows the count (no exact-count key).
    cut = {n: last_cut(n, reused.local, reused.remote) for _, _, n in requests}
    structures = {(cut[n], tuple(map(len, local)), tuple(map(len, remote))): (local, remote, n)
                  for local, remote, n in requests}
    assert len(structures) == 5
    assert len(reused._packs) == sum(len(reused.plan(*r, PlanMode.PACK).sources) for r in structures.values())
    assert all(isinstance(r, PackRecipe) for r in reused._packs.values())


def test_pack_recipe_arrays_are_shared_read_only():
    """Plans of one shape share the recipe's arrays, so none may be written through a plan."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8)
    local, remote = request_ids(model, producers, consumers, 3000, 1.0)
    planner = Planner(model, consumers[0], producers)
    planner.plan(local, remote, 3000, PlanMode.PACK)
    (src,) = planner.plan(local, remote, 3000, PlanMode.PACK).sources  # the second: from the shape's recipe
    with pytest.raises(ValueError, match="read-only"):
        src.read.length[0] = 0
    with pytest.raises(ValueError, match="read-only"):
        src.layout.offset[0] = 1


def test_unvalidated_plan_with_too_few_blocks_raises_instead_of_reading_another_group():
    model = load_preset(Q397)
    producers, consumers = engines(model, 1, 1)
    local, remote = request_ids(model, producers, consumers, 5000, 0.0)
    short = [list(local[0])[:-1]] + [list(g) for g in local[1:]]
    with pytest.raises(PlanError, match="too few"):
        Planner(model, consumers[0], producers).plan(short, remote, 5000, validate=False)
