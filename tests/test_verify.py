"""The global-coordinate oracle (hybrid_transfer.verify) against hand-made copies written here through views.

The reference copy below knows nothing of descriptors either: per layer it gathers the source ranks'
views into a global tensor indexed by (K/V, global head, token) or (global channel, window position)
or (global value head, ...), then scatters that into the destination rank's views by its own global
coordinates. Correct copies must pass; each kind of wrong copy must raise VerificationError.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer import verify
from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError, VerificationError
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    DType,
    KVLayout,
    LayerKind,
    RankGeometry,
    SsmOrder,
    model_from_config,
)
from hybrid_transfer.verify import (
    POISON_BYTE,
    PatternKind,
    RequestLayout,
    check_destination,
    check_destination_many,
    conv_pattern,
    describe_byte,
    expected_destination,
    fill_source,
    kv_pattern,
    make_request,
    make_requests,
    pattern_base,
    pattern_value,
    poison,
    ssm_pattern,
)

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SEED = 11


def tiny_model(dtype: str = "bfloat16", ssm_dtype: str = "float32", layer_types: list[str] | None = None):
    """K=2 heads of 8, GDN nk=4 / nv=8 heads of 4, conv kernel 4: TP 1, 2 and 4 (replicated KV) all shard it."""
    cfg = {
        "num_hidden_layers": len(layer_types) if layer_types else 8,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "linear_num_key_heads": 4,
        "linear_num_value_heads": 8,
        "linear_key_head_dim": 4,
        "linear_value_head_dim": 4,
        "linear_conv_kernel_dim": 4,
        "dtype": dtype,
        "mamba_ssm_dtype": ssm_dtype,
    }
    if layer_types:
        cfg["layer_types"] = layer_types
    else:
        cfg["full_attention_interval"] = 4
    return model_from_config(cfg, name="tiny")


# Two attention groups and one GDN group (more FA layers than GDN layers).
TWO_FA_GROUPS = ["full_attention", "full_attention", "linear_attention"] * 2


def ints(t: torch.Tensor) -> torch.Tensor:
    return t.view(INT[t.element_size()])


def kv6(cache: HybridCache, layer: int) -> torch.Tensor:
    """[block, kernel block, K/V, head slot, token, element] over the cache, whatever the KV layout."""
    g = cache.geometry
    k = ints(cache.k(layer))
    it = g.kv_itemsize
    shape = (cache.num_blocks, g.kernel_ratio, 2, g.num_kv_heads_local, g.kernel_block_size, g.model.head_dim)
    strides = (g.page_bytes // it, g.kernel_block_bytes // it, g.kv_half_stride // it, g.kv_head_stride // it,
               g.kv_token_stride // it, 1)
    return k.as_strided(shape, strides, k.storage_offset())


def token_slots(cache: HybridCache, ids, tokens: torch.Tensor):
    """(block id, kernel block, token in kernel block) of request tokens, by the request model's rule."""
    g = cache.geometry
    blocks = torch.tensor(ids, dtype=torch.int64)[tokens // g.block_size]
    pos = tokens % g.block_size
    return blocks, pos // g.kernel_block_size, pos % g.kernel_block_size


def copy_state(srcs, src_block: int, dst: HybridCache, dst_block: int, layer: int, flat_conv: bool = False):
    m = dst.geometry.model
    w = m.conv_window
    if flat_conv:  # the wrong rule docs/sharding.md#flat-split warns about: one flat split of conv_dim
        glob = torch.zeros(m.conv_dim, w, dtype=ints(dst.conv(layer)).dtype)
        for s in srcs:
            c = s.geometry.conv_dim_local
            glob[s.geometry.tp_rank * c : (s.geometry.tp_rank + 1) * c] = ints(s.conv(layer))[src_block]
        c = dst.geometry.conv_dim_local
        ints(dst.conv(layer))[dst_block] = glob[dst.geometry.tp_rank * c : (dst.geometry.tp_rank + 1) * c]
    else:
        widths = (m.linear_num_key_heads * m.linear_key_head_dim,) * 2 + (
            m.linear_num_value_heads * m.linear_value_head_dim,)
        for segment, width in enumerate(widths):
            glob = torch.zeros(width, w, dtype=ints(dst.conv(layer)).dtype)
            for s in srcs:
                lo, r = s.geometry.conv_segment_channel_offsets[segment], s.geometry.conv_channel_ranges[segment]
                glob[r.start : r.stop] = ints(s.conv(layer))[src_block][lo : lo + len(r)]
            lo, r = dst.geometry.conv_segment_channel_offsets[segment], dst.geometry.conv_channel_ranges[segment]
            ints(dst.conv(layer))[dst_block][lo : lo + len(r)] = glob[r.start : r.stop]
    ssm_d = ints(dst.ssm(layer))
    glob = torch.zeros(m.linear_num_value_heads, *ssm_d.shape[2:], dtype=ssm_d.dtype)
    for s in srcs:
        vh = s.geometry.value_heads
        glob[vh.start : vh.stop] = ints(s.ssm(layer))[src_block]
    vh = dst.geometry.value_heads
    ssm_d[dst_block] = glob[vh.start : vh.stop]


def reference_copy(srcs, src_req: RequestLayout, dst: HybridCache, dst_req: RequestLayout, *,
                   token_offset: int = 0, flat_conv: bool = False, move_state: bool | None = None):
    """Move request tokens [0, n) and the state from all source ranks into one destination rank, by global index."""
    n = dst_req.num_tokens
    m = dst.geometry.model
    for gi, group in enumerate(dst.geometry.tensor_map.groups):
        src_ids, dst_ids = src_req.block_ids[gi], dst_req.block_ids[gi]
        for layer in group.layers:
            if group.kind is LayerKind.ATTENTION:
                if n == 0:
                    continue
                t = torch.arange(n)
                glob = torch.zeros(n, 2, m.num_kv_heads, m.head_dim, dtype=kv6(dst, layer).dtype)
                for s in srcs:
                    b, k, tok = token_slots(s, src_ids, t + token_offset)
                    glob[:, :, list(s.geometry.kv_heads)] = kv6(s, layer)[b, k, :, :, tok, :]
                b, k, tok = token_slots(dst, dst_ids, t)
                kv6(dst, layer)[b, k, :, :, tok, :] = glob[:, :, list(dst.geometry.kv_heads)]
            elif (n > 0) if move_state is None else move_state:
                copy_state(srcs, src_ids[0], dst, dst_ids[0], layer, flat_conv)


def engine(model, tp: int, options: CacheOptions | None, num_blocks: int) -> list[HybridCache]:
    return [HybridCache.allocate(RankGeometry(model, tp, r, options), num_blocks) for r in range(tp)]


def setup_transfer(model, src_tp: int, dst_tp: int, n: int, *, src_opts=None, dst_opts=None, seed: int = SEED,
                   fragmentation: float = 0.0, extra: int = 0, rng: int = 0, spare: int = 3):
    """Filled source ranks, poisoned destination ranks and the two engines' block ids for one request."""
    sg, dg = RankGeometry(model, src_tp, 0, src_opts), RankGeometry(model, dst_tp, 0, dst_opts)
    groups = sg.tensor_map.groups
    pool_s = sum(sg.num_blocks_for_tokens(n) if g.kind is LayerKind.ATTENTION else 1 for g in groups) + spare
    pool_d = sum(dg.num_blocks_for_tokens(n) + extra if g.kind is LayerKind.ATTENTION else 1 for g in groups) + spare
    src_req = make_request(sg, n, pool_s, rng, fragmentation)
    dst_req = make_request(dg, n, pool_d, rng + 1, fragmentation, extra_local_blocks=extra)
    srcs, dsts = engine(model, src_tp, src_opts, pool_s), engine(model, dst_tp, dst_opts, pool_d)
    for c in srcs:
        poison(c)
        fill_source(c, src_req, seed)
    for c in dsts:
        poison(c)
    return srcs, src_req, dsts, dst_req


# ---- the pattern -----------------------------------------------------------------------------------

@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_pattern_matches_scalar_reference(itemsize):
    """The vectorised hash equals the pure-Python one (guards torch int64 wrap-around and shifts)."""
    kv = kv_pattern(3, 7, range(1, 3), range(5, 9), 6, itemsize).view(INT[itemsize])
    mask = (1 << (8 * itemsize)) - 1
    for half, kind in enumerate((PatternKind.K, PatternKind.V)):
        for hi, head in enumerate(range(1, 3)):
            for ti, tok in enumerate(range(5, 9)):
                for e in range(6):
                    want = pattern_value(pattern_base(3, 7, kind), (head, tok), e, 8 * itemsize)
                    assert int(kv[half, hi, ti, e]) & mask == want
    conv = conv_pattern(3, 2, 1, range(4, 7), 3, itemsize)
    ssm = ssm_pattern(3, 2, range(2, 4), 2, 3, itemsize)
    for ci, ch in enumerate(range(4, 7)):
        for p in range(3):
            want = pattern_value(pattern_base(3, 2, PatternKind.CONV_K), (ch,), p, 8 * itemsize)
            assert int(conv[ci, p]) & mask == want
    for vi, vh in enumerate(range(2, 4)):
        for a in range(2):
            for b in range(3):
                want = pattern_value(pattern_base(3, 2, PatternKind.SSM), (vh,), a * 3 + b, 8 * itemsize)
                assert int(ssm[vi, a, b]) & mask == want


@pytest.mark.parametrize("poison_byte", [POISON_BYTE, 0x00, 0xFF])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
def test_pattern_never_holds_poison_byte_and_is_spread(itemsize, poison_byte):
    pat = kv_pattern(1, 0, range(4), range(2048), 16, itemsize, poison_byte).contiguous()
    lanes = pat.view(torch.uint8)
    assert not bool((lanes == poison_byte).any())
    # Well mixed: each byte's bit 0 is pinned (opposite to the poison's), the other 7 bits take every value,
    # and the 7 * itemsize free bits of a value are nearly all distinct.
    assert bool(((lanes & 1) != (poison_byte & 1)).all())
    assert len(torch.unique(lanes)) == 128
    assert len(torch.unique(pat)) > 0.6 * min(pat.numel(), 1 << (7 * itemsize))


def test_pattern_depends_on_every_coordinate():
    base = kv_pattern(5, 3, range(2), range(4), 8, 2)
    assert not torch.equal(base, kv_pattern(6, 3, range(2), range(4), 8, 2))  # seed
    assert not torch.equal(base, kv_pattern(5, 7, range(2), range(4), 8, 2))  # layer
    assert not torch.equal(base[0], base[1])  # K vs V
    assert not torch.equal(base[:, 0], base[:, 1])  # head
    assert not torch.equal(base[:, :, 1:], kv_pattern(5, 3, range(2), range(3), 8, 2)[:, :, :])  # token shift
    assert not torch.equal(base[..., 1:], base[..., :-1])  # element shift
    assert not torch.equal(conv_pattern(5, 3, 0, range(8), 3, 2), conv_pattern(5, 3, 1, range(8), 3, 2))  # Q vs K


# ---- fill_source -----------------------------------------------------------------------------------

@pytest.mark.parametrize("layers", [None, TWO_FA_GROUPS])
def test_fill_source_writes_every_byte_of_the_request_and_nothing_else(layers):
    model = tiny_model(layer_types=layers)
    g = RankGeometry(model, 1, 0, CacheOptions(block_size=16, kernel_block_size=4))
    cache = HybridCache.allocate(g, 24)
    req = make_request(g, 21, 24, rng=4, fragmentation=1.0)
    poison(cache)
    fill_source(cache, req, SEED)
    held = {b for ids in req.block_ids for b in ids}
    for j in range(g.num_tensors):
        pages = cache.raw(j)
        for b in range(cache.num_blocks):
            untouched = pages[b] == POISON_BYTE
            if b in held:  # the pattern never holds the poison byte: every byte changed, padding included
                assert not bool(untouched.any()), (j, b)
            else:
                assert bool(untouched.all()), (j, b)


def test_fill_source_places_pattern_at_view_coordinates():
    """Source views hold the pattern at their global coordinates: heads, token t = i*B + pos, segments, ssm axes."""
    opts = CacheOptions(block_size=16, kernel_block_size=4, conv_layout=ConvLayout.SD, ssm_order=SsmOrder.V_K_D)
    g = RankGeometry(tiny_model(), 2, 1, opts)
    m = g.model
    cache = HybridCache.allocate(g, 12)
    req = make_request(g, 40, 12, rng=2, fragmentation=1.0)
    fill_source(cache, req, SEED)
    ids = req.block_ids[0]
    tokens = torch.arange(len(ids) * g.block_size)  # tails included on the source
    for layer in m.attention_layers:
        b, k, tok = token_slots(cache, ids, tokens)
        got = kv6(cache, layer)[b, k, :, :, tok, :].permute(1, 2, 0, 3)  # [2, heads, tokens, head_dim]
        want = kv_pattern(SEED, layer, g.kv_heads, range(len(tokens)), m.head_dim, g.kv_itemsize)
        assert torch.equal(got, want)
    gi = g.tensor_map.groups_of(LayerKind.GDN)[0]
    block = req.block_ids[gi][0]
    for layer in g.tensor_map.groups[gi].layers:
        conv = ints(cache.conv(layer))[block]
        for segment, channels in enumerate(g.conv_channel_ranges):
            lo = g.conv_segment_channel_offsets[segment]
            want = conv_pattern(SEED, layer, segment, channels, m.conv_window, g.conv_itemsize)
            assert torch.equal(conv[lo : lo + len(channels)], want)
        want = ssm_pattern(SEED, layer, g.value_heads, m.linear_value_head_dim, m.linear_key_head_dim,
                           g.ssm_dtype.itemsize)
        assert torch.equal(ints(cache.ssm(layer))[block], want.transpose(1, 2))


def test_chunked_pattern_writes_match_unchunked(monkeypatch):
    """Big caches are written a few blocks at a time; every chunk must carry its own token positions."""
    opts = CacheOptions(block_size=16, kernel_block_size=4)
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 1, 45, src_opts=opts, dst_opts=opts,
                                            fragmentation=1.0)
    reference_copy(srcs, sreq, dsts[0], dreq)
    whole = expected_destination(dsts[0], dreq, SEED)
    monkeypatch.setattr(verify, "_CHUNK_ELEMS", 1)
    assert all(torch.equal(a, b) for a, b in zip(whole, expected_destination(dsts[0], dreq, SEED), strict=True))
    check_destination(dsts[0], dreq, SEED)


def test_poison_fills_every_byte():
    g = RankGeometry(tiny_model(), 2, 1)
    cache = HybridCache.allocate(g, 5)
    poison(cache, 0x3C)
    assert all(bool((t == 0x3C).all()) for t in cache.tensors)
    with pytest.raises(ConfigError):
        poison(cache, 256)


# ---- correct copies pass ---------------------------------------------------------------------------

DTYPE_CASES = [
    # (model dtype, ssm dtype, kv dtype override)
    ("bfloat16", "float32", None),
    ("bfloat16", "bfloat16", DType.FP8),
    ("float32", "float32", None),
    ("float16", "float32", DType.FP16),
]


@pytest.mark.parametrize(("dtype", "ssm_dtype", "kv_dtype"), DTYPE_CASES)
@pytest.mark.parametrize("conv_layout", list(ConvLayout))
@pytest.mark.parametrize("n", [0, 1, 13, 32])
def test_same_tp_reference_copy_passes(dtype, ssm_dtype, kv_dtype, conv_layout, n):
    opts = CacheOptions(kv_dtype=kv_dtype, alignment=8, kernel_block_size=None, conv_layout=conv_layout)
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(dtype, ssm_dtype), 1, 1, n, src_opts=opts, dst_opts=opts,
                                            fragmentation=0.5, extra=1)
    reference_copy(srcs, sreq, dsts[0], dreq)
    check_destination(dsts[0], dreq, SEED)
    if n == 0:  # nothing moves at all
        assert all(bool((t == POISON_BYTE).all()) for t in dsts[0].tensors)


def test_expected_destination_matches_a_correct_copy_byte_for_byte():
    opts = CacheOptions(block_size=16, kernel_block_size=4, ssm_order=SsmOrder.V_K_D, conv_layout=ConvLayout.SD)
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 1, 19, src_opts=opts, dst_opts=opts)
    reference_copy(srcs, sreq, dsts[0], dreq)
    want = expected_destination(dsts[0], dreq, SEED)
    assert all(torch.equal(a, b) for a, b in zip(dsts[0].tensors, want, strict=True))
    assert not torch.equal(want[0], expected_destination(dsts[0], dreq, SEED + 1)[0])


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "src_opts", "dst_opts"),
    [
        (1, 2, CacheOptions(block_size=16, kernel_block_size=4), CacheOptions(block_size=24)),
        (2, 1, CacheOptions(block_size=16), CacheOptions(block_size=32, kernel_block_size=8)),
        (1, 4, CacheOptions(), CacheOptions(block_size=8, kernel_block_size=2)),  # TP4 > K=2: replicated heads
        (4, 2, CacheOptions(conv_layout=ConvLayout.SD), CacheOptions(block_size=24, conv_layout=ConvLayout.SD)),
    ],
)
def test_different_tp_reference_copy_passes_and_rank_mixups_fail(src_tp, dst_tp, src_opts, dst_opts):
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), src_tp, dst_tp, 29, src_opts=src_opts,
                                            dst_opts=dst_opts, fragmentation=1.0)
    for d in dsts:
        reference_copy(srcs, sreq, d, dreq)
        check_destination(d, dreq, SEED)
    if dst_tp > 1:  # rank 1's bytes are not rank 0's
        with pytest.raises(VerificationError):
            check_destination(HybridCache.wrap(dsts[0].geometry, dsts[1].tensors), dreq, SEED)
    if src_tp > 1:  # a copy that takes source rank 1 for rank 0 (and back) is caught
        swapped = [HybridCache.wrap(srcs[1 - r].geometry, srcs[r].tensors) for r in (0, 1)] + srcs[2:]
        poison(dsts[0])
        reference_copy(swapped, sreq, dsts[0], dreq)
        with pytest.raises(VerificationError):
            check_destination(dsts[0], dreq, SEED)


def test_flat_conv_split_across_tp_is_caught():
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 2, 5)
    reference_copy(srcs, sreq, dsts[1], dreq, flat_conv=True)
    with pytest.raises(VerificationError) as info:
        check_destination(dsts[1], dreq, SEED)
    assert "conv byte" in info.value.location


def test_attention_only_model():
    model = model_from_config({"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 8,
                               "full_attention_interval": 1, "dtype": "bfloat16"})
    srcs, sreq, dsts, dreq = setup_transfer(model, 2, 1, 10, src_opts=CacheOptions(block_size=4),
                                            dst_opts=CacheOptions(block_size=8))
    reference_copy(srcs, sreq, dsts[0], dreq)
    check_destination(dsts[0], dreq, SEED)


def test_several_requests_in_one_cache():
    model = tiny_model()
    g = RankGeometry(model, 1, 0, CacheOptions(block_size=16))
    counts = [0, 7, 40]
    src_reqs = make_requests(g, counts, 20, rng=1, fragmentation=1.0)
    dst_reqs = make_requests(g, counts, 24, rng=2, fragmentation=0.3, extra_local_blocks=1)
    src, dst = HybridCache.allocate(g, 20), HybridCache.allocate(g, 24)
    poison(src)
    poison(dst)
    for i, (sr, dr) in enumerate(zip(src_reqs, dst_reqs, strict=True)):
        fill_source(src, sr, SEED + i)
        reference_copy([src], sr, dst, dr)
    check_destination_many(dst, [(r, SEED + i) for i, r in enumerate(dst_reqs)])
    with pytest.raises(VerificationError) as info:  # request 2's bytes are unexpected when only request 1 is named
        check_destination(dst, dst_reqs[1], SEED + 1)
    assert "held by no request" in info.value.location


# ---- wrong copies fail -----------------------------------------------------------------------------

def _swap(a: torch.Tensor, b: torch.Tensor) -> None:
    tmp = a.clone()
    a.copy_(b)
    b.copy_(tmp)


def _first_fa_layer(cache):
    return cache.geometry.model.attention_layers[0]


def _first_gdn(cache, req):
    g = cache.geometry
    gi = g.tensor_map.groups_of(LayerKind.GDN)[0]
    return g.tensor_map.groups[gi].layers[0], req.block_ids[gi][0]


def mutate_swap_kv(srcs, sreq, dst, dreq):
    page = kv6(dst, _first_fa_layer(dst))[dreq.block_ids[0][0]]
    _swap(page[:, 0], page[:, 1])


def mutate_swap_heads(srcs, sreq, dst, dreq):
    page = kv6(dst, _first_fa_layer(dst))[dreq.block_ids[0][0]]
    _swap(page[:, :, 0], page[:, :, 1])


def mutate_tail_token(srcs, sreq, dst, dreq):
    """Also move token n, the first one past num_tokens, that the source holds in its partial last block."""
    n, layer = dreq.num_tokens, _first_fa_layer(dst)
    sb, sk, st_ = token_slots(srcs[0], sreq.block_ids[0], torch.tensor([n]))
    db, dk, dt = token_slots(dst, dreq.block_ids[0], torch.tensor([n]))
    kv6(dst, layer)[db, dk, :, :, dt, :] = kv6(srcs[0], layer)[sb, sk, :, :, st_, :]


def mutate_whole_state_page(srcs, sreq, dst, dreq):
    """Copy state pages whole, padding included (docs/planner.md#token-rules: never send page padding)."""
    layer, db = _first_gdn(dst, dreq)
    _, sb = _first_gdn(srcs[0], sreq)
    j = dst.geometry.tensor_of(layer)
    dst.raw(j)[db] = srcs[0].raw(j)[sb]


def mutate_other_block(srcs, sreq, dst, dreq):
    held = {b for ids in dreq.block_ids for b in ids}
    free = next(b for b in range(dst.num_blocks) if b not in held)
    dst.raw(0)[free, 3] = 0


def mutate_ssm_transposed(srcs, sreq, dst, dreq):
    layer, db = _first_gdn(dst, dreq)
    ssm = ints(dst.ssm(layer))[db]
    ssm.copy_(ssm.transpose(1, 2).contiguous())


def mutate_conv_segments_swapped(srcs, sreq, dst, dreq):
    layer, db = _first_gdn(dst, dreq)
    conv = ints(dst.conv(layer))[db]
    q = len(dst.geometry.conv_channel_ranges[0])
    _swap(conv[:q], conv[q : 2 * q])


def mutate_off_by_one_token(srcs, sreq, dst, dreq):
    poison(dst)
    reference_copy(srcs, sreq, dst, dreq, token_offset=1)


MUTATIONS = {
    "off_by_one_token": (mutate_off_by_one_token, "attention"),
    "swap_kv": (mutate_swap_kv, "attention K byte"),
    "swap_heads": (mutate_swap_heads, "global head 0"),
    "tail_token": (mutate_tail_token, "tail, past num_tokens"),
    "state_page_padding": (mutate_whole_state_page, "state page padding"),
    "other_block": (mutate_other_block, "held by no request"),
    "ssm_transposed": (mutate_ssm_transposed, "ssm byte"),
    "conv_q_k_swapped": (mutate_conv_segments_swapped, "conv byte, segment Q"),
}


@pytest.mark.parametrize("conv_layout", list(ConvLayout))
@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_wrong_copy_raises(name, conv_layout):
    mutate, where = MUTATIONS[name]
    opts = CacheOptions(block_size=16, kernel_block_size=4, conv_layout=conv_layout)
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 1, 21, src_opts=opts, dst_opts=opts,
                                            fragmentation=1.0)
    dst = dsts[0]
    reference_copy(srcs, sreq, dst, dreq)
    check_destination(dst, dreq, SEED)
    mutate(srcs, sreq, dst, dreq)
    with pytest.raises(VerificationError) as info:
        check_destination(dst, dreq, SEED)
    err = info.value
    assert where in err.location
    assert err.num_bad_bytes > 0
    assert err.block_id == err.first_bad_offset // dst.geometry.page_bytes
    assert err.actual_byte == int(dst.tensors[err.tensor_index][err.first_bad_offset])
    assert err.expected_byte != err.actual_byte


def test_describe_byte_decodes_global_coordinates():
    opts = CacheOptions(block_size=16, kernel_block_size=4, conv_layout=ConvLayout.SD)
    g = RankGeometry(tiny_model(), 2, 1, opts)
    req = RequestLayout(block_ids=((5, 2), (0,), (1,), (3,)), num_tokens=20)
    # V half, head slot 0 (global head 1), kernel block 1, token 2 of block 2 (list index 1): token 16 + 4 + 2.
    offset = g.kv_offset(2, 1, 1, 0, 2) + 3 * g.kv_itemsize + 1
    block, text = describe_byte(g, [req], 0, offset)
    assert block == 2
    assert "attention V byte, global head 1, token 22 (tail, past num_tokens=20)" in text
    assert "element 3 byte 1" in text
    # SD conv: window position 2, local channel of V segment -> global V channel of rank 1.
    lo = g.conv_segment_channel_offsets[2]
    local = lo + 3
    offset = 3 * g.page_bytes + (2 * g.conv_dim_local + local) * g.conv_itemsize
    _, text = describe_byte(g, [req], 1, offset)
    assert f"conv byte, segment V global channel {g.conv_channel_ranges[2][3]}, window position 2" in text
    _, text = describe_byte(g, [req], 1, g.ssm_offset(1) + g.ssm_head_bytes + 4 * 5)
    assert f"ssm byte, global value head {g.value_heads[1]}, (dv, dk) = (1, 1)" in text
    _, text = describe_byte(g, [req], 0, 4 * g.page_bytes + 7)
    assert text == "block 4 (held by no request), page byte 7"


def test_state_moved_for_zero_tokens_raises():
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 1, 0)
    reference_copy(srcs, sreq, dsts[0], dreq, move_state=True)
    with pytest.raises(VerificationError) as info:
        check_destination(dsts[0], dreq, SEED)
    assert "conv byte" in info.value.location


def test_wrong_seed_raises():
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 1, 3)
    reference_copy(srcs, sreq, dsts[0], dreq)
    with pytest.raises(VerificationError):
        check_destination(dsts[0], dreq, SEED + 1)


def test_error_counts_bad_bytes_over_all_tensors():
    srcs, sreq, dsts, dreq = setup_transfer(tiny_model(), 1, 1, 5)
    dst = dsts[0]
    reference_copy(srcs, sreq, dst, dreq)
    dst.tensors[1][7] ^= 1
    dst.tensors[1][9] ^= 1
    dst.tensors[0][dst.geometry.page_bytes + 2] ^= 0x10
    with pytest.raises(VerificationError) as info:
        check_destination(dst, dreq, SEED)
    assert (info.value.tensor_index, info.value.first_bad_offset, info.value.num_bad_bytes) == (
        0, dst.geometry.page_bytes + 2, 3)


# ---- property: correct copies pass, any single flipped byte is found exactly -------------------------

@st.composite
def transfers(draw):
    layers = draw(st.sampled_from([None, TWO_FA_GROUPS]))
    dtype, ssm_dtype, kv_dtype = draw(st.sampled_from(DTYPE_CASES))
    model = tiny_model(dtype, ssm_dtype, layers)
    ssm_order = draw(st.sampled_from(list(SsmOrder)))  # both sides agree: the handshake makes them

    def options(tp):
        conv_layout = draw(st.sampled_from(list(ConvLayout)))
        base = CacheOptions(kv_dtype=kv_dtype, alignment=draw(st.sampled_from([2, 4, 8, 16])), conv_layout=conv_layout)
        # Explicit block sizes are multiples of the derived one, so the state page always fits.
        block = RankGeometry(model, tp, 0, base).block_size * draw(st.integers(1, 3))
        ratio = draw(st.sampled_from([r for r in (1, 2, 4) if block % r == 0]))
        return CacheOptions(kv_dtype=kv_dtype, block_size=block, kernel_block_size=block // ratio,
                            conv_layout=conv_layout, ssm_order=ssm_order)

    src_tp, dst_tp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2, 4]))
    src_opts, dst_opts = options(src_tp), options(dst_tp)
    return dict(model=model, src_tp=src_tp, dst_tp=dst_tp, src_opts=src_opts, dst_opts=dst_opts,
                n=draw(st.integers(0, 60)), fragmentation=draw(st.sampled_from([0.0, 0.5, 1.0])),
                extra=draw(st.integers(0, 1)), rng=draw(st.integers(0, 1000)))


@settings(max_examples=40, deadline=None)
@given(case=transfers(), data=st.data())
def test_property_reference_copy_passes_and_any_flipped_byte_is_pinpointed(case, data):
    srcs, sreq, dsts, dreq = setup_transfer(case["model"], case["src_tp"], case["dst_tp"], case["n"],
                                            src_opts=case["src_opts"], dst_opts=case["dst_opts"],
                                            fragmentation=case["fragmentation"], extra=case["extra"],
                                            rng=case["rng"])
    rank = data.draw(st.integers(0, case["dst_tp"] - 1))
    dst = dsts[rank]
    reference_copy(srcs, sreq, dst, dreq)
    check_destination(dst, dreq, SEED)
    j = data.draw(st.integers(0, dst.geometry.num_tensors - 1))
    offset = data.draw(st.integers(0, dst.tensors[j].numel() - 1))
    dst.tensors[j][offset] ^= data.draw(st.sampled_from([0x01, 0x80, 0xFF]))
    with pytest.raises(VerificationError) as info:
        check_destination(dst, dreq, SEED)
    err = info.value
    assert (err.tensor_index, err.first_bad_offset, err.num_bad_bytes) == (j, offset, 1)


# ---- make_request(s) and request validation --------------------------------------------------------

def test_make_request_counts_and_contiguity():
    g = RankGeometry(tiny_model(), 1, 0, CacheOptions(block_size=16))
    req = make_request(g, 33, 50, rng=0, extra_local_blocks=2)
    kinds = [grp.kind for grp in g.tensor_map.groups]
    assert [len(ids) for ids in req.block_ids] == [3 + 2 if k is LayerKind.ATTENTION else 1 for k in kinds]
    flat = [b for ids in req.block_ids for b in ids]
    assert flat == list(range(flat[0], flat[0] + len(flat)))
    empty = make_request(g, 0, 50, rng=0)
    assert [len(ids) for ids in empty.block_ids] == [0 if k is LayerKind.ATTENTION else 1 for k in kinds]
    assert empty.num_tokens == 0


@pytest.mark.parametrize("fragmentation", [0.25, 0.5, 1.0])
def test_make_request_fragmentation(fragmentation):
    g = RankGeometry(tiny_model(), 4, 0, CacheOptions(block_size=8))
    req = make_request(g, 1600, 400, rng=np.random.default_rng(5), fragmentation=fragmentation)
    flat = [b for ids in req.block_ids for b in ids]
    assert len(set(flat)) == len(flat) and all(0 <= b < 400 for b in flat)
    steps = np.diff(flat)
    assert (steps != 1).sum() > 0
    if fragmentation < 1.0:  # most positions keep their place in one ascending run
        assert (steps == 1).mean() > 0.5 * (1 - fragmentation) ** 2
    full = make_request(g, 1600, len(flat), rng=3, fragmentation=1.0)
    ids = sorted(b for group in full.block_ids for b in group)
    assert ids == list(range(len(flat)))  # pool == need: a permutation


def test_make_requests_do_not_overlap_and_pool_too_small_raises():
    g = RankGeometry(tiny_model(), 2, 0, CacheOptions(block_size=16))
    reqs = make_requests(g, [5, 0, 17, 8], 30, rng=9, fragmentation=0.7)
    flat = [b for r in reqs for ids in r.block_ids for b in ids]
    assert len(set(flat)) == len(flat)
    assert [r.num_tokens for r in reqs] == [5, 0, 17, 8]
    need = sum(len(ids) for r in reqs for ids in r.block_ids)
    with pytest.raises(ConfigError):
        make_requests(g, [5, 0, 17, 8], need - 1, rng=9)
    with pytest.raises(ConfigError):
        make_request(g, 5, 30, fragmentation=1.5)
    with pytest.raises(ConfigError):
        make_request(g, -1, 30)


@pytest.mark.parametrize(
    "block_ids",
    [
        ((0, 1), (2,), (3,), (99,)),  # out of range
        ((0, 1), (1,), (3,), (4,)),  # shared across groups
        ((0,), (2,), (3,), (4,)),  # too few attention blocks for 20 tokens
        ((0, 1), (2, 5), (3,), (4,)),  # two state blocks
        ((0, 1), (2,), (3,)),  # a group missing
    ],
)
def test_invalid_request_raises_config_error(block_ids):
    g = RankGeometry(tiny_model(), 1, 0, CacheOptions(block_size=16))
    assert [grp.kind for grp in g.tensor_map.groups] == [LayerKind.ATTENTION] + [LayerKind.GDN] * 3
    cache = HybridCache.allocate(g, 8)
    req = RequestLayout(block_ids=block_ids, num_tokens=20)
    with pytest.raises(ConfigError):
        fill_source(cache, req, SEED)
    with pytest.raises(ConfigError):
        check_destination(cache, req, SEED)


def test_requests_sharing_a_block_raise():
    g = RankGeometry(tiny_model(), 1, 0, CacheOptions(block_size=16))
    cache = HybridCache.allocate(g, 8)
    a = RequestLayout(block_ids=((0,), (1,), (2,), (3,)), num_tokens=4)
    b = RequestLayout(block_ids=((3,), (4,), (5,), (6,)), num_tokens=4)
    with pytest.raises(ConfigError):
        check_destination_many(cache, [(a, 1), (b, 2)])


def test_block_count_rule_matches_ceil():
    g = RankGeometry(tiny_model(), 1, 0, CacheOptions(block_size=16))
    for n in (1, 15, 16, 17, 64):
        assert len(make_request(g, n, 20, rng=0).block_ids[0]) == math.ceil(n / 16)


# ---- naive's whole pages: only the last page's tail may be skipped ------------------------------------

@pytest.mark.parametrize("layout", list(KVLayout))
def test_skip_attention_tails_ignores_only_the_unused_tail_of_the_last_page(layout):
    g = RankGeometry(tiny_model(), 1, 0, CacheOptions(block_size=16, kernel_block_size=4, kv_layout=layout))
    request = RequestLayout(block_ids=((5, 2, 7), (0,), (1,), (3,)), num_tokens=21)  # block 7: extra local block
    cache = HybridCache.allocate(g, 9)
    for mine, want in zip(cache.tensors, expected_destination(cache, request, SEED), strict=True):
        mine.copy_(want)
    check_destination(cache, request, SEED)
    layer = _first_fa_layer(cache)

    def poke(block: int, token: int, half: int) -> None:
        view = ints(cache.k(layer) if half == 0 else cache.v(layer)).view(9, g.kernel_ratio, g.num_kv_heads_local,
                                                                            g.kernel_block_size, g.model.head_dim)
        view[block, token // g.kernel_block_size, -1, token % g.kernel_block_size, 0] ^= 0x5A

    poke(2, 21 - 16, 1)  # token 21, the first tail token of the last page (block 2), V of the last head
    poke(2, 15, 0)  # token 31, the last token of that page
    with pytest.raises(VerificationError, match="tail, past num_tokens=21"):
        check_destination(cache, request, SEED)
    check_destination(cache, request, SEED, skip_attention_tails=True)
    poke(2, 4, 0)  # token 20: the last valid one
    with pytest.raises(VerificationError, match=r"token 20 \(valid\)"):
        check_destination(cache, request, SEED, skip_attention_tails=True)
    poke(2, 4, 0)  # undo (xor)
    check_destination(cache, request, SEED, skip_attention_tails=True)
    poke(7, 0, 0)  # the extra block past the last page: never a tail, always poison
    with pytest.raises(VerificationError, match="block 7"):
        check_destination(cache, request, SEED, skip_attention_tails=True)
