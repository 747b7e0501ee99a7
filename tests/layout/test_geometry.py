"""RankGeometry against the check numbers of docs/presets.md#check-numbers and docs/layout.md#page-size-unification and the sharding contract of docs/sharding.md."""

from __future__ import annotations

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.errors import ConfigError, ShardingError
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    ConvSegment,
    DType,
    KVLayout,
    RankGeometry,
    load_preset,
    preset_names,
)

BIG = "qwen3.5-397b-a17b"
MIB = 1 << 20
TPS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def big():
    return load_preset(BIG)


# ---- docs/presets.md#check-numbers ---------------------------------------------------------------------

@pytest.mark.parametrize(("tp", "mib"), [(1, "183.16"), (2, "91.58"), (4, "45.79"), (8, "22.90")])
def test_state_bytes_per_request_397b(big, tp, mib):
    g = RankGeometry(big, tp)
    conv, ssm = 73_728 // tp, 4_194_304 // tp
    assert (g.conv_bytes, g.ssm_bytes) == (conv, ssm)
    assert g.state_bytes_per_request == 45 * (conv + ssm)
    assert g.state_bytes_per_request == {1: 192_061_440, 2: 96_030_720, 4: 48_015_360, 8: 24_007_680}[tp]
    assert f"{g.state_bytes_per_request / MIB:.2f}" == mib


@pytest.mark.parametrize(("tp", "per_layer"), [(1, 2048), (2, 1024), (4, 1024), (8, 1024)])
def test_kv_bytes_per_token_397b(big, tp, per_layer):
    g = RankGeometry(big, tp)
    assert g.kv_bytes_per_token == per_layer
    assert g.kv_bytes_per_token * len(big.attention_layers) == {2048: 30_720, 1024: 15_360}[per_layer]
    assert g.describe()["kv_bytes_per_token_all_layers"] == 15 * per_layer


def test_conv_segments_397b_tp1(big):
    g = RankGeometry(big, 1)
    # [Q | K | V] widths nk*dk, nk*dk, nv*dv = 2048, 2048, 8192 channels, 3 positions, bf16.
    assert g.conv_dim_local == 12_288
    assert g.conv_segment_bytes == (2048 * 3 * 2, 2048 * 3 * 2, 8192 * 3 * 2)
    assert sum(g.conv_segment_bytes) == g.conv_bytes == 73_728


# ---- docs/layout.md#page-size-unification ---------------------------------------------------------------------

@pytest.mark.parametrize(("tp", "block"), [(1, 2096), (2, 2096), (4, 1056), (8, 528)])
def test_block_size_bf16_397b(big, tp, block):
    g = RankGeometry(big, tp)
    assert g.block_size == block
    assert g.page_bytes == block * g.kv_bytes_per_token


@pytest.mark.parametrize(("tp", "block"), [(1, 4176), (8, 1056)])
def test_block_size_fp8_397b(big, tp, block):
    g = RankGeometry(big, tp, options=CacheOptions(kv_dtype=DType.FP8))
    assert g.kv_dtype is DType.FP8
    assert g.block_size == block


def test_kernel_ratio_131_for_flashattention_blocks(big):
    g = RankGeometry(big, 1, options=CacheOptions(kernel_block_size=16))
    assert (g.block_size, g.kernel_block_size, g.kernel_ratio) == (2096, 16, 131)
    assert g.kernel_block_bytes * g.kernel_ratio == g.page_bytes
    assert g.kv_half_bytes == 2 * 16 * 256 * 2  # 2 heads x 16 tokens x 256 dims, bf16: HND half of a kernel block


@pytest.mark.parametrize("name", preset_names())
def test_equal_block_sizes_only_when_both_tp_within_kv_heads(name):
    """docs/layout.md#page-size-unification consequence: two TP sizes give equal block sizes only if both are <= K or they are equal."""
    m = load_preset(name)
    sizes = {tp: RankGeometry(m, tp).block_size for tp in TPS}
    for a in TPS:
        for b in TPS:
            if a != b and not (a <= m.num_kv_heads and b <= m.num_kv_heads):
                assert sizes[a] != sizes[b], (a, b, sizes)
            if a <= m.num_kv_heads and b <= m.num_kv_heads:
                assert sizes[a] == sizes[b], (a, b, sizes)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(preset_names()), tp=st.sampled_from(TPS),
       kv=st.sampled_from([DType.BF16, DType.FP16, DType.FP8]), align=st.sampled_from([1, 16, 32, 64, 528]))
def test_block_size_is_smallest_aligned_page_holding_state(name, tp, kv, align):
    g = RankGeometry(load_preset(name), tp, options=CacheOptions(kv_dtype=kv, alignment=align))
    attn_1tok = 2 * g.num_kv_heads_local * g.model.head_dim * kv.itemsize
    assert g.kv_bytes_per_token == attn_1tok
    assert g.block_size % align == 0
    assert g.page_bytes >= g.state_page_bytes
    assert g.block_size == align * math.ceil(g.state_page_bytes / (align * attn_1tok))
    assert (g.block_size - align) * attn_1tok < g.state_page_bytes


def test_explicit_block_size_wins(big):
    g = RankGeometry(big, 8, options=CacheOptions(block_size=1056, kernel_block_size=32))
    assert (g.block_size, g.kernel_ratio, g.page_bytes) == (1056, 33, 1056 * 1024)


# ---- docs/sharding.md ---------------------------------------------------------------------------

@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", preset_names())
def test_kv_heads_per_rank(name, tp):
    m = load_preset(name)
    k = m.num_kv_heads
    holders = {h: 0 for h in range(k)}
    for r in range(tp):
        g = RankGeometry(m, tp, r)
        expected = range(r * k // tp, (r + 1) * k // tp) if tp <= k else range(r * k // tp, r * k // tp + 1)
        assert g.kv_heads == expected
        assert g.num_kv_heads_local == len(expected)
        assert g.kv_heads_replicated == (tp > k)
        for h in g.kv_heads:
            holders[h] += 1
    # Every head is held: once when T <= K, T/K times when replicated.
    assert set(holders.values()) == {max(1, tp // k)}


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("name", preset_names())
def test_conv_channels_and_value_heads_per_rank(name, tp):
    m = load_preset(name)
    nk, nv, dk, dv = m.linear_num_key_heads, m.linear_num_value_heads, m.linear_key_head_dim, m.linear_value_head_dim
    qk, v = nk * dk, nv * dv
    for r in range(tp):
        g = RankGeometry(m, tp, r)
        q_r, k_r, v_r = g.conv_channel_ranges
        assert q_r == range(r * qk // tp, (r + 1) * qk // tp)
        assert k_r == q_r
        assert v_r == range(r * v // tp, (r + 1) * v // tp)
        assert g.conv_segment_channel_offsets == (0, len(q_r), 2 * len(q_r))
        assert g.conv_dim_local == m.conv_dim // tp
        assert g.conv_bytes == g.conv_dim_local * 3 * 2
        assert g.value_heads == range(r * nv // tp, (r + 1) * nv // tp)
        # Value head j uses key head j // (nv/nk): exactly this rank's own key heads.
        used_key_heads = {j // (nv // nk) for j in g.value_heads}
        assert used_key_heads == set(range(r * nk // tp, (r + 1) * nk // tp))
        assert g.ssm_bytes == len(g.value_heads) * dv * dk * m.ssm_dtype.itemsize


# ---- offsets inside a page -------------------------------------------------------------------------

def test_split_kv_offset_is_heads_tokens_inside_k_and_v_halves(big):
    g = RankGeometry(big, 1, options=CacheOptions(kernel_block_size=16, kv_layout=KVLayout.SPLIT))
    hd_bytes = 256 * 2
    assert g.kv_offset(0, 0, 0) == 0
    assert g.kv_offset(0, 0, 0, head_slot=0, token=1) == hd_bytes
    assert g.kv_offset(0, 0, 0, head_slot=1) == 16 * hd_bytes  # a head's 16 tokens are contiguous
    assert g.kv_offset(0, 0, 1) == 2 * 16 * hd_bytes  # V after both K heads
    assert g.kv_offset(0, 1, 0) == 4 * 16 * hd_bytes  # next [K|V] pair
    assert g.kv_offset(3, 2, 1, 1, 5) == 3 * g.page_bytes + 2 * g.kernel_block_bytes + g.kv_half_bytes + (16 + 5) * hd_bytes


def test_interleaved_kv_offset_puts_k_and_v_of_a_token_side_by_side(big):
    g = RankGeometry(big, 1, options=CacheOptions(kernel_block_size=16))
    assert g.kv_layout is KVLayout.INTERLEAVED  # the default: vLLM 0.33's [heads][tokens][K|V]
    hd_bytes = 256 * 2
    assert g.kv_offset(0, 0, 0) == 0
    assert g.kv_offset(0, 0, 1) == hd_bytes  # V of token 0 right after its K
    assert g.kv_offset(0, 0, 0, head_slot=0, token=1) == 2 * hd_bytes
    assert g.kv_offset(0, 0, 0, head_slot=1) == 16 * 2 * hd_bytes  # a head's 16 tokens, K and V, are one range
    assert g.kv_offset(0, 1, 0) == 2 * 16 * 2 * hd_bytes  # next kernel block
    assert g.kv_offset(3, 2, 1, 1, 5) == 3 * g.page_bytes + 2 * g.kernel_block_bytes + ((16 + 5) * 2 + 1) * hd_bytes
    # Page and kernel block sizes do not depend on the layout; only offsets inside a kernel block do.
    split = RankGeometry(big, 1, options=CacheOptions(kernel_block_size=16, kv_layout=KVLayout.SPLIT))
    assert (g.page_bytes, g.kernel_block_bytes, g.block_size) == (split.page_bytes, split.kernel_block_bytes,
                                                                   split.block_size)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("tp", "kbs"), [(1, None), (1, 16), (8, None), (8, 48)])
def test_kv_offsets_tile_a_kernel_block_exactly(big, layout, tp, kbs):
    """Every (half, head, token, byte) of a kernel block maps to a distinct offset inside it: a bijection."""
    g = RankGeometry(big, tp, options=CacheOptions(kernel_block_size=kbs, kv_layout=layout))
    h, n, htb = g.num_kv_heads_local, g.kernel_block_size, g.head_token_bytes
    starts = sorted(g.kv_offset(0, 1, half, slot, tok) for half in (0, 1) for slot in range(h) for tok in range(n))
    assert starts[0] == g.kernel_block_bytes
    assert all(b - a == htb for a, b in itertools.pairwise(starts))
    assert starts[-1] + htb == 2 * g.kernel_block_bytes


def test_kernel_block_defaults_to_logical_block(big):
    for tp in (1, 2, 4, 8):
        g = RankGeometry(big, tp)
        assert (g.kernel_block_size, g.kernel_ratio) == (g.block_size, 1)


def test_state_offsets_are_conv_then_ssm(big):
    g = RankGeometry(big, 2)
    s0, s1, _ = g.conv_segment_bytes
    assert g.conv_segment_offset(5, ConvSegment.Q) == 5 * g.page_bytes
    assert g.conv_segment_offset(5, ConvSegment.K) == 5 * g.page_bytes + s0
    assert g.conv_segment_offset(5, ConvSegment.V) == 5 * g.page_bytes + s0 + s1
    assert g.ssm_offset(5) == 5 * g.page_bytes + g.conv_bytes
    assert g.describe()["padding_bytes_per_state_page"] == g.page_bytes - g.conv_bytes - g.ssm_bytes


def test_sd_layout_has_no_single_segment_range(big):
    g = RankGeometry(big, 1, options=CacheOptions(conv_layout=ConvLayout.SD))
    with pytest.raises(ConfigError, match="DS") as info:
        g.conv_segment_offset(0, ConvSegment.K)
    assert info.value.value == "SD"


def test_describe_has_cli_keys(big):
    d = RankGeometry(big, 8, 5).describe()
    for key in ("block_size", "page_bytes", "kv_bytes_per_token", "conv_bytes", "ssm_bytes",
                "state_bytes_per_request", "num_fa_layers", "num_gdn_layers", "num_tensors", "kv_heads",
                "kv_layout"):
        assert key in d
    assert d["kv_layout"] == "interleaved"
    assert RankGeometry(big, 8, options=CacheOptions(kv_layout=KVLayout.SPLIT)).describe()["kv_layout"] == "split"
    assert (d["tp_rank"], d["kv_heads"], d["num_fa_layers"], d["num_gdn_layers"]) == (5, [1, 2], 15, 45)


# ---- typed errors ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("name", "tp"), [(BIG, 3), ("qwen3.5-27b", 3), ("qwen3.5-27b", 6)])
def test_tp_not_dividing_kv_heads(name, tp):
    with pytest.raises(ShardingError, match=f"tp_size={tp}") as info:
        RankGeometry(load_preset(name), tp)
    assert (info.value.field, info.value.value) == ("tp_size", tp)
    assert "num_key_value_heads" in str(info.value)


def test_tp_not_dividing_linear_heads():
    # 32 is a multiple of K=2 (replication is fine) but does not divide the 16 GDN key heads, hence not their
    # conv channels either. (nv is a multiple of nk, so a TP dividing nk always divides nv.)
    with pytest.raises(ShardingError, match="linear_num_key_heads=16") as info:
        RankGeometry(load_preset(BIG), 32)
    assert info.value.value == 32
    assert "tp_size=32" in str(info.value)


@pytest.mark.parametrize("tp", [0, -2])
def test_non_positive_tp(big, tp):
    with pytest.raises(ShardingError, match=f"tp_size={tp}"):
        RankGeometry(big, tp)


@pytest.mark.parametrize("rank", [-1, 8])
def test_rank_out_of_range(big, rank):
    with pytest.raises(ShardingError, match=f"tp_rank={rank}") as info:
        RankGeometry(big, 8, rank)
    assert info.value.value == rank


@pytest.mark.parametrize(("options", "field", "value"), [
    (CacheOptions(block_size=0), "block_size", 0),
    (CacheOptions(block_size=-16), "block_size", -16),
    (CacheOptions(block_size=16), "block_size", 16),  # page too small for the 4 MiB state
    (CacheOptions(alignment=0), "alignment", 0),
    (CacheOptions(kernel_block_size=0), "kernel_block_size", 0),
    (CacheOptions(kernel_block_size=-16), "kernel_block_size", -16),
    (CacheOptions(kernel_block_size=100), "kernel_block_size", 100),  # does not divide 528
])
def test_bad_block_options_name_value(big, options, field, value):
    with pytest.raises(ConfigError, match=f"{field}={value}") as info:
        RankGeometry(big, 8, options=options)
    assert (info.value.field, info.value.value) == (field, value)
