"""Planner: DESIGN 3 formulas and worked example, modes, notifications, pack plans, construction checks."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_transfer.errors import FingerprintMismatch, PlanError, TopologyError
from hybrid_transfer.layout import CacheOptions, DType, LayerKind, RankGeometry, load_preset, model_from_config
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode, SourcePlan
from hybrid_transfer.plan.validate import expected_bytes

Q397 = "qwen3.5-397b-a17b"


def engines(model, p, d, prefill=None, decode=None, pool=64):
    return fake_engine(model, p, prefill, pool, 0), fake_engine(model, d, decode, pool, 1)


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


# ---- DESIGN 3 worked example --------------------------------------------------------------------------

def test_worked_example_p2_d8_fragmented():
    """qwen3.5-397b-a17b, 8192 tokens, P2 -> D8 fragmented: 19 ranges per FA layer and half, 570 + 180 pieces."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8)
    assert (producers[0].block_size, consumers[0].block_size) == (2096, 528)
    local, remote = request_ids(model, producers, consumers, 8192, 1.0)
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
        assert kv_len.shape[0] == 19 * 2  # one tensor holds one FA layer: 19 ranges per half
        assert np.count_nonzero(kv_len == 270_336) >= 2 * 12
        assert set(kv_len[kv_len != 270_336].tolist()) <= {t * 512 for t in range(1, 529)}
        assert sorted(set(src.length[in_tensor0][~is_kv].tolist())) == [1536, 6144, 524_288]
        assert src.num_descriptors == 750
        assert np.count_nonzero(np.isin(src.length, [1536, 6144, 524_288])) == 180
        assert plan.notify[0].source_rank == d // 4 and plan.notify[0].expected_consumers == 4


def test_p1_d1_contiguous_coalesces_whole_blocks_and_conv_with_ssm():
    model = load_preset(Q397)
    producers, consumers = engines(model, 1, 1)
    local, remote = request_ids(model, producers, consumers, 8192, 0.0)
    planner = Planner(model, consumers[0], producers)
    naive = planner.plan(local, remote, 8192, PlanMode.NAIVE)
    coalesced = planner.plan(local, remote, 8192, PlanMode.COALESCED)
    # Per tensor: blocks 0-2 and block 3's first K head merge into one range, 3 more for the partial block,
    # one conv|ssm range per GDN group (equal TP): 7. Naive: 10 KV halves + 12 state sub-regions.
    assert coalesced.num_descriptors == 15 * 7
    assert naive.num_descriptors == 15 * 22
    assert naive.total_bytes == coalesced.total_bytes == expected_bytes(planner.local, 8192)


# ---- formulas -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("preset,p,d", [(Q397, 2, 8), (Q397, 1, 4), ("qwen3.5-27b", 2, 4), ("qwen3.5-4b", 1, 2)])
def test_fan_out_state_is_the_three_read_conv_and_an_ssm_slice(preset, p, d):
    """DESIGN 3: Q at o*s0, K at r*s0 + o*s1, V at r*s0 + r*s1 + o*s2, ssm at remote_conv + o*local_ssm."""
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


@pytest.mark.parametrize("p,d,bs_p,kb_p,bs_d,kb_d", [(2, 4, 48, 16, 40, 8), (1, 4, 64, 64, 24, 8),
                                                     (2, 8, 32, 8, 48, 48)])
def test_kv_pieces_follow_the_design_formula_with_different_block_sizes(p, d, bs_p, kb_p, bs_d, kb_d):
    """One local head; per head: remote offset (head - first_head(src)) * B_s * hd * b + t0 * hd * b inside the remote half."""
    model = load_preset("qwen3.5-27b")  # K = 4: unreplicated at TP <= 4, replicated at TP 8
    prefill = CacheOptions(block_size=bs_p * 64, kernel_block_size=kb_p)
    decode = CacheOptions(block_size=bs_d * 64, kernel_block_size=kb_d)
    producers, consumers = engines(model, p, d, prefill, decode)
    n = 1000
    local, remote = request_ids(model, producers, consumers, n, 1.0, seed=5)
    for rank in range(d):
        planner = Planner(model, consumers[rank], producers)
        lg, rg = planner.local, planner.remote
        src_rank = rank // (d // p)
        src_geo = RankGeometry(model, p, src_rank, prefill)
        (src,) = planner.plan(local, remote, n, PlanMode.NAIVE).sources
        got = rows(src)
        htb = model.head_dim * 2
        cuts = sorted({0, n} | set(range(lg.kernel_block_size, n, lg.kernel_block_size))
                      | set(range(rg.kernel_block_size, n, rg.kernel_block_size)))
        want = set()
        for t0, t1 in zip(cuts[:-1], cuts[1:], strict=True):
            lb, lt = divmod(t0, lg.block_size)
            rb, rt = divmod(t0, rg.block_size)
            for half in (0, 1):
                for slot, head in enumerate(lg.kv_heads):
                    lo = (local[0][lb] * lg.page_bytes + (lt // lg.kernel_block_size) * lg.kernel_block_bytes
                          + half * lg.kv_half_bytes + slot * lg.kernel_block_size * htb
                          + (lt % lg.kernel_block_size) * htb)
                    ro = (remote[0][rb] * rg.page_bytes + (rt // rg.kernel_block_size) * rg.kernel_block_bytes
                          + half * rg.kv_half_bytes
                          + (head - src_geo.first_kv_head) * rg.kernel_block_size * htb
                          + (rt % rg.kernel_block_size) * htb)
                    for j in range(lg.num_tensors):
                        want.add((consumers[rank].tensor_addrs[j] + lo, producers[src_rank].tensor_addrs[j] + ro,
                                  (t1 - t0) * htb))
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

@pytest.mark.parametrize("preset", ["qwen3-next-80b-a3b", Q397, "qwen3.5-27b", "qwen3.5-0.8b"])
@pytest.mark.parametrize("p,d", [(1, 1), (1, 8), (8, 1), (2, 4), (4, 2), (8, 8)])
@pytest.mark.parametrize("fragmentation", [0.0, 1.0])
def test_coalesced_never_has_more_descriptors_than_naive_and_same_bytes(preset, p, d, fragmentation):
    model = load_preset(preset)
    producers, consumers = engines(model, p, d, pool=128)
    local, remote = request_ids(model, producers, consumers, 5000, fragmentation)
    for rank in sorted({0, d - 1}):
        planner = Planner(model, consumers[rank], producers)
        naive = planner.plan(local, remote, 5000, PlanMode.NAIVE)
        coalesced = planner.plan(local, remote, 5000, PlanMode.COALESCED)
        assert coalesced.num_descriptors <= naive.num_descriptors
        for a, b in zip(naive.sources, coalesced.sources, strict=True):
            assert a.num_descriptors >= b.num_descriptors
            assert a.total_bytes == b.total_bytes


def test_coalesced_rows_ascend_within_each_tensor():
    model = load_preset(Q397)
    producers, consumers = engines(model, 1, 1)
    local, remote = request_ids(model, producers, consumers, 7000, 0.0)
    (src,) = Planner(model, consumers[0], producers).plan(local, remote, 7000).sources
    per_tensor = src.local_addr.reshape(15, -1)
    assert np.all(np.diff(per_tensor, axis=1) > 0)
    assert np.all(np.diff(src.remote_addr.reshape(15, -1), axis=1) > 0)  # contiguous ids: ascending on both sides


def test_pack_plan_is_the_coalesced_plan_in_source_order_with_prefix_staging():
    model = load_preset(Q397)
    producers, consumers = engines(model, 8, 2)
    local, remote = request_ids(model, producers, consumers, 3000, 1.0)
    planner = Planner(model, consumers[0], producers)
    direct = planner.plan(local, remote, 3000, PlanMode.COALESCED)
    pack = planner.plan(local, remote, 3000, PlanMode.PACK)
    assert pack.num_descriptors == len(pack.sources) == 4
    for d_src, p_src in zip(direct.sources, pack.sources, strict=True):
        assert isinstance(p_src, PackSourcePlan)
        assert np.all(np.diff(p_src.gather_src) > 0)
        assert p_src.staging_offset.tolist() == np.concatenate(([0], np.cumsum(p_src.length)[:-1])).tolist()
        assert rows(d_src) == set(zip(p_src.scatter_dst.tolist(), p_src.gather_src.tolist(),
                                      p_src.length.tolist(), strict=True))


def test_producer_computes_the_same_pack_plan_as_the_consumer():
    """The producer builds the planner from the consumer's descriptor (handshake) and gets identical rows."""
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 8)
    local, remote = request_ids(model, producers, consumers, 3000, 1.0)
    consumer_side = Planner(model, consumers[6], producers).plan(local, remote, 3000, PlanMode.PACK).sources[0]
    wire = [RankDescriptor(**{f: getattr(c, f) for f in RankDescriptor.__struct_fields__}) for c in consumers]
    producer_side = Planner(model, wire[6], producers).pack_plan(1, local, remote, 3000)
    for name in ("gather_src", "scatter_dst", "staging_offset", "length"):
        assert np.array_equal(getattr(consumer_side, name), getattr(producer_side, name))
    with pytest.raises(PlanError):
        Planner(model, consumers[6], producers).pack_plan(0, local, remote, 3000)


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


def test_descriptor_that_disagrees_with_its_geometry_is_refused():
    model = load_preset(Q397)
    producers, consumers = engines(model, 2, 2)
    fields = {f: getattr(producers[1], f) for f in RankDescriptor.__struct_fields__}
    fields["page_bytes"] += 2
    with pytest.raises(PlanError):
        Planner(model, consumers[0], [producers[0], RankDescriptor(**fields)])
