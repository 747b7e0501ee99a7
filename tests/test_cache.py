"""HybridCache views alias exactly the bytes the registry reports (docs/layout.md#the-cache-over-real-memory), over real memory."""

from __future__ import annotations

from itertools import pairwise

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import CacheShapeError, ConfigError
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    ConvSegment,
    DType,
    KVLayout,
    LayerKind,
    RankGeometry,
    SsmOrder,
    load_preset,
    model_from_config,
)

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32}
SPLIT = KVLayout.SPLIT
INTERLEAVED = KVLayout.INTERLEAVED


# ---- helpers ----------------------------------------------------------------------------------------

def as_int(view: torch.Tensor) -> torch.Tensor:
    """Same bytes, integer elements: writing random ints copies bits exactly (no float NaN canonicalisation)."""
    return view.view(_INT_OF_SIZE[view.element_size()])


def random_like(view: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (view.numel() * view.element_size(),), dtype=torch.uint8, generator=gen).view(
        _INT_OF_SIZE[view.element_size()]).view(view.shape)


def view_bytes(view: torch.Tensor) -> torch.Tensor:
    return as_int(view).contiguous().view(torch.uint8).reshape(-1)


def locate(cache: HybridCache, addr: int, length: int) -> tuple[int, int]:
    """(tensor index, offset) of an absolute byte range; it must lie inside one region."""
    for i, region in enumerate(cache.regions):
        if region.addr <= addr and addr + length <= region.addr + region.length:
            return i, addr - region.addr
    raise AssertionError(f"range {addr:#x}+{length} is in no region")


def bytes_at(cache: HybridCache, addr: int, length: int) -> torch.Tensor:
    i, off = locate(cache, addr, length)
    return cache.raw(i).reshape(-1)[off : off + length]


def snapshot(cache: HybridCache) -> list[torch.Tensor]:
    """A copy of every shared tensor, kept in step with the writes a test makes (the expected memory)."""
    return [cache.raw(i).clone().reshape(-1) for i in range(cache.geometry.num_tensors)]


def assert_memory_is(cache: HybridCache, expected: list[torch.Tensor]) -> None:
    for i, want in enumerate(expected):
        # numpy compares MiBs ~15x faster than torch.equal on uint8 CPU tensors.
        assert np.array_equal(cache.raw(i).reshape(-1).numpy(), want.numpy()), f"tensor {i} differs outside the range"


def check_alias(cache: HybridCache, view: torch.Tensor, addr: int, length: int, gen: torch.Generator,
                expected: list[torch.Tensor] | None = None) -> None:
    """Write through the view -> the reported bytes hold it and nothing else moved; write raw -> view reads it."""
    assert view.numel() * view.element_size() == length
    expected = snapshot(cache) if expected is None else expected
    i, off = locate(cache, addr, length)
    pattern = random_like(view, gen)
    as_int(view).copy_(pattern)
    expected[i][off : off + length] = pattern.contiguous().view(torch.uint8).reshape(-1)
    assert_memory_is(cache, expected)
    raw = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=gen)
    bytes_at(cache, addr, length).copy_(raw)
    expected[i][off : off + length] = raw
    assert torch.equal(view_bytes(view), raw)


def footprint(view: torch.Tensor) -> tuple[int, torch.Tensor]:
    """(storage address, bool mask over the storage's bytes) of every byte a strided view touches."""
    storage = view.untyped_storage()
    size = view.element_size()
    index = torch.arange(storage.nbytes() // size, dtype=torch.int64)
    elems = torch.as_strided(index, view.shape, view.stride(), view.storage_offset()).reshape(-1)
    offsets = (elems[:, None] * size + torch.arange(size)[None, :]).reshape(-1)
    mask = torch.zeros(storage.nbytes(), dtype=torch.bool)
    mask[offsets] = True
    return storage.data_ptr(), mask


def layer_footprint(cache: HybridCache, layer: int) -> tuple[int, torch.Tensor]:
    if cache.geometry.model.layer_kinds[layer] is LayerKind.ATTENTION:
        return footprint(cache.kv(layer))
    addr, conv = footprint(cache.conv(layer))
    addr2, ssm = footprint(cache.ssm(layer))
    assert addr == addr2
    assert not (conv & ssm).any()  # conv and ssm of one layer never overlap
    return addr, conv | ssm


def conv_segment(cache: HybridCache, layer: int, block: int, seg: ConvSegment) -> torch.Tensor:
    g = cache.geometry
    start = g.conv_segment_channel_offsets[int(seg)]
    return cache.conv(layer)[block, start : start + len(g.conv_channel_ranges[int(seg)])]


def check_every_range(cache: HybridCache, gen: torch.Generator, layers=None, blocks=None, kernels=None) -> None:
    """check_alias for every K/V half, conv segment and ssm part of the given layers and blocks."""
    g = cache.geometry
    layers = range(g.model.num_layers) if layers is None else layers
    blocks = range(cache.num_blocks) if blocks is None else blocks
    kernels = range(g.kernel_ratio) if kernels is None else kernels
    expected = snapshot(cache)
    for layer in layers:
        for b in blocks:
            if g.model.layer_kinds[layer] is LayerKind.ATTENTION:
                for k in kernels:
                    kb = b * g.kernel_ratio + k
                    check_alias(cache, cache.kv(layer)[kb], *cache.kernel_block_range(layer, b, k), gen, expected)
                    if g.kv_layout is SPLIT:
                        for half in (0, 1):
                            view = cache.kv(layer)[kb, half]
                            check_alias(cache, view, *cache.kv_range(layer, b, k, half), gen, expected)
                    else:
                        # A head's tokens, K and V together, are one byte range.
                        base = cache.raw(g.tensor_of(layer)).data_ptr()
                        for slot in range(g.num_kv_heads_local):
                            check_alias(cache, cache.kv(layer)[kb, slot], base + g.kv_offset(b, k, 0, slot),
                                        g.kv_head_stride, gen, expected)
            else:
                for seg in ConvSegment:
                    view = conv_segment(cache, layer, b, seg)
                    check_alias(cache, view, *cache.conv_range(layer, b, seg), gen, expected)
                check_alias(cache, cache.ssm(layer)[b], *cache.ssm_range(layer, b), gen, expected)


# ---- allocation, regions, shapes ---------------------------------------------------------------------

def test_allocate_regions(tiny_model):
    g = RankGeometry(tiny_model, 1)
    cache = HybridCache.allocate(g, 3)
    assert (g.page_bytes, g.num_tensors, cache.num_blocks) == (1024, 2, 3)
    regions = cache.regions
    assert [r.length for r in regions] == [3 * 1024] * 2
    assert [r.addr for r in regions] == [t.data_ptr() for t in cache.tensors]
    assert all(r.device_id == 0 and not r.is_cuda for r in regions)
    a, b = sorted(regions, key=lambda r: r.addr)
    assert a.addr + a.length <= b.addr
    assert all(int(t.abs().sum()) == 0 for t in cache.tensors)  # zeroed


@pytest.mark.parametrize(("layout", "kv_shape"), [(SPLIT, (2 * 33, 2, 1, 16, 256)), (INTERLEAVED, (2 * 33, 1, 16, 512))])
def test_view_shapes_and_dtypes_397b_tp8(layout, kv_shape):
    g = RankGeometry(load_preset("qwen3.5-397b-a17b"), 8, 3, CacheOptions(kernel_block_size=16, kv_layout=layout))
    cache = HybridCache.allocate(g, 2)
    kv = cache.kv(3)
    assert kv.shape == kv_shape and kv.dtype == torch.bfloat16
    assert cache.k(3).shape == cache.v(3).shape == (2 * 33, 1, 16, 256)
    conv = cache.conv(0)
    assert conv.shape == (2, 12_288 // 8, 3) and conv.dtype == torch.bfloat16
    ssm = cache.ssm(58)
    assert ssm.shape == (2, 8, 128, 128) and ssm.dtype == torch.float32


def test_view_dtypes_follow_options(tiny_model):
    g = RankGeometry(tiny_model, 2, options=CacheOptions(kv_dtype=DType.FP8, ssm_dtype=DType.BF16))
    cache = HybridCache.allocate(g, 1)
    assert cache.kv(3).dtype == torch.float8_e4m3fn
    assert cache.ssm(0).dtype == torch.bfloat16


# ---- views alias the reported byte ranges -----------------------------------------------------------

@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_every_view_aliases_its_range_tiny(tiny_model, tp, layout):
    g = RankGeometry(tiny_model, tp, tp - 1, CacheOptions(kernel_block_size=4, kv_layout=layout))
    check_every_range(HybridCache.allocate(g, 3), torch.Generator().manual_seed(tp))


@pytest.mark.parametrize(("tp", "rank", "layout"), [(8, 5, SPLIT), (4, 2, SPLIT), (8, 5, INTERLEAVED), (2, 1, INTERLEAVED)])
def test_views_alias_ranges_397b(tp, rank, layout):
    g = RankGeometry(load_preset("qwen3.5-397b-a17b"), tp, rank, CacheOptions(kernel_block_size=16, kv_layout=layout))
    assert g.kernel_ratio == {8: 33, 4: 66, 2: 131}[tp]
    cache = HybridCache.allocate(g, 2)
    # Layers on the first and last tensor, first and last GDN group; first, second and last kernel block.
    check_every_range(cache, torch.Generator().manual_seed(tp), layers=[0, 2, 3, 56, 59], blocks=[1],
                      kernels=[0, 1, g.kernel_ratio - 1])


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_views_alias_ranges_property(tiny_model, data):
    tp = data.draw(st.sampled_from([1, 2, 4]))
    kv = data.draw(st.sampled_from([DType.BF16, DType.FP16, DType.FP8]))
    ssm = data.draw(st.sampled_from([DType.FP32, DType.BF16]))
    align = data.draw(st.sampled_from([8, 16, 32]))
    layout = data.draw(st.sampled_from(list(KVLayout)))
    g0 = RankGeometry(tiny_model, tp, options=CacheOptions(kv_dtype=kv, ssm_dtype=ssm, alignment=align))
    kbs = data.draw(st.sampled_from([d for d in (1, 2, 4, 8, 16, 32) if g0.block_size % d == 0]))
    g = RankGeometry(tiny_model, tp, data.draw(st.integers(0, tp - 1)),
                     CacheOptions(kv_dtype=kv, ssm_dtype=ssm, alignment=align, kernel_block_size=kbs,
                                  kv_layout=layout))
    cache = HybridCache.allocate(g, data.draw(st.integers(1, 3)))
    layer = data.draw(st.integers(0, tiny_model.num_layers - 1))
    block = data.draw(st.integers(0, cache.num_blocks - 1))
    check_every_range(cache, torch.Generator().manual_seed(data.draw(st.integers(0, 2**31))), [layer], [block])


def test_split_kv_head_is_one_byte_range_per_half(tiny_model):
    g = RankGeometry(tiny_model, 1, options=CacheOptions(kernel_block_size=8, kv_layout=SPLIT))
    cache = HybridCache.allocate(g, 2)
    base = cache.raw(g.tensor_of(7)).data_ptr()
    gen = torch.Generator().manual_seed(7)
    for half in (0, 1):
        for head in range(g.num_kv_heads_local):
            view = cache.kv(7)[1 * g.kernel_ratio + 1, half, head]
            length = g.kernel_block_size * g.head_token_bytes
            check_alias(cache, view, base + g.kv_offset(1, 1, half, head_slot=head), length, gen)


@pytest.mark.parametrize("layout", list(KVLayout))
def test_logical_block_is_ratio_consecutive_kernel_blocks(tiny_model, layout):
    g = RankGeometry(tiny_model, 1, options=CacheOptions(kernel_block_size=4, kv_layout=layout))
    assert g.kernel_ratio == 4
    cache = HybridCache.allocate(g, 3)
    kv = cache.kv(3)
    assert kv.shape[0] == 12
    addr, page = footprint(kv[2 * 4 : 2 * 4 + 4])
    assert addr == cache.raw(0).data_ptr()
    expected = torch.zeros_like(page)
    expected[2 * g.page_bytes : 3 * g.page_bytes] = True
    assert torch.equal(page, expected)  # logical block 2 is exactly page 2


def _kv_element_offsets(g: RankGeometry, num_blocks: int, half: int) -> torch.Tensor:
    """Byte offset of every element of the k (half 0) or v (half 1) view, from the geometry's arithmetic alone."""
    nkb = num_blocks * g.kernel_ratio
    kb = torch.arange(nkb).view(-1, 1, 1, 1)
    blocks, kidx = kb // g.kernel_ratio, kb % g.kernel_ratio
    slot = torch.arange(g.num_kv_heads_local).view(1, -1, 1, 1)
    tok = torch.arange(g.kernel_block_size).view(1, 1, -1, 1)
    elem = torch.arange(g.model.head_dim).view(1, 1, 1, -1)
    return (blocks * g.page_bytes + kidx * g.kernel_block_bytes + half * g.kv_half_stride
            + slot * g.kv_head_stride + tok * g.kv_token_stride + elem * g.kv_itemsize)


@pytest.mark.parametrize("layout", list(KVLayout))
@pytest.mark.parametrize(("tp", "kbs", "kv_dtype"), [(1, None, DType.BF16), (1, 4, DType.FP8), (2, 8, DType.FP16),
                                                     (4, None, DType.BF16)])
def test_k_and_v_views_alias_kv_offsets(tiny_model, layout, tp, kbs, kv_dtype):
    """Writes through k / v land exactly at kv_offset, together cover every attention byte, and never overlap."""
    g = RankGeometry(tiny_model, tp, tp - 1, CacheOptions(kernel_block_size=kbs, kv_layout=layout, kv_dtype=kv_dtype))
    cache = HybridCache.allocate(g, 3)
    item = g.kv_itemsize
    raw = cache.raw(g.tensor_of(3)).reshape(-1)
    gen = torch.Generator().manual_seed(tp)
    covered = torch.zeros(raw.numel(), dtype=torch.bool)
    for half, view in enumerate((cache.k(3), cache.v(3))):
        assert view.shape == (3 * g.kernel_ratio, g.num_kv_heads_local, g.kernel_block_size, g.model.head_dim)
        assert view.dtype == cache.kv(3).dtype
        pattern = random_like(view, gen)
        as_int(view).copy_(pattern)
        offsets = _kv_element_offsets(g, 3, half)
        got = raw.view(_INT_OF_SIZE[item])[offsets // item]
        assert torch.equal(got, pattern)
        addr, mask = footprint(view)
        assert addr == raw.data_ptr()
        assert not (covered & mask).any()
        covered |= mask
    assert bool(covered.all())  # K and V tile the attention pages: no byte left, none shared


def test_k_and_v_are_the_natural_view_sliced(tiny_model):
    cache = HybridCache.allocate(RankGeometry(tiny_model, 1), 2)
    hd = tiny_model.head_dim
    kv = cache.kv(3)
    assert kv.shape == (2, tiny_model.num_kv_heads, cache.geometry.block_size, 2 * hd)
    as_int(cache.v(3)).fill_(7)
    assert bool((as_int(kv)[..., hd:] == 7).all()) and int(as_int(kv)[..., :hd].abs().sum()) == 0
    split = HybridCache.allocate(RankGeometry(tiny_model, 1, options=CacheOptions(kv_layout=SPLIT)), 2)
    as_int(split.k(3)).fill_(5)
    assert bool((as_int(split.kv(3))[:, 0] == 5).all()) and int(as_int(split.kv(3))[:, 1].abs().sum()) == 0


def test_sd_conv_view_is_transposed(tiny_model):
    g = RankGeometry(tiny_model, 2, options=CacheOptions(conv_layout=ConvLayout.SD))
    cache = HybridCache.allocate(g, 2)
    conv = cache.conv(5)
    w, c = tiny_model.conv_window, g.conv_dim_local
    assert conv.shape == (2, c, w)
    page = cache.raw(g.tensor_of(5))[1, : g.conv_bytes].view(torch.int16).view(w, c)  # stored (w-1) x conv_dim
    page.copy_(torch.arange(w * c, dtype=torch.int16).view(w, c))
    ints = as_int(conv[1])
    for ch in (0, 1, c - 1):
        for s in range(w):
            assert int(ints[ch, s]) == s * c + ch
    with pytest.raises(ConfigError, match="DS"):
        cache.conv_range(5, 0, ConvSegment.Q)


def test_ds_conv_view_is_channels_outer(tiny_model):
    g = RankGeometry(tiny_model, 1)
    cache = HybridCache.allocate(g, 1)
    w, c = tiny_model.conv_window, g.conv_dim_local
    cache.raw(g.tensor_of(4))[0, : g.conv_bytes].view(torch.int16).copy_(torch.arange(w * c, dtype=torch.int16))
    ints = as_int(cache.conv(4)[0])
    assert int(ints[5, 2]) == 5 * w + 2


@pytest.mark.parametrize(("order", "inner"), [(SsmOrder.V_D_K, "dv,dk"), (SsmOrder.V_K_D, "dk,dv")])
def test_ssm_axis_order(tiny_config, order, inner):
    tiny_config["linear_value_head_dim"] = 8  # dv != dk so the two orders have different shapes
    m = model_from_config(tiny_config)
    g = RankGeometry(m, 2, options=CacheOptions(ssm_order=order))
    cache = HybridCache.allocate(g, 1)
    ssm = cache.ssm(1)
    dv, dk = 8, 4
    shape = (1, 4, dv, dk) if inner == "dv,dk" else (1, 4, dk, dv)
    assert ssm.shape == shape
    # Element (head 1, 2, 3) sits at conv_bytes + ((1*a + 2)*b + 3) * 4 for inner shape (a, b).
    a, b = shape[2:]
    ints = as_int(ssm)
    ints[0, 1, 2, 3] = 0x01020304
    off = g.conv_bytes + ((1 * a + 2) * b + 3) * 4
    raw = cache.raw(g.tensor_of(1))[0]
    assert int(raw[off : off + 4].view(torch.int32)) == 0x01020304


# ---- which views share bytes (docs/layout.md#the-layer-to-tensor-map) -----------------------------------------------------------

def _footprints(cache):
    return {layer: layer_footprint(cache, layer) for layer in range(cache.geometry.model.num_layers)}


@pytest.mark.parametrize(("preset", "tp"), [(None, 1), (None, 4), ("qwen3.5-0.8b", 8)])
def test_layers_share_bytes_only_on_the_same_tensor(tiny_model, preset, tp):
    g = RankGeometry(tiny_model if preset is None else load_preset(preset), tp)
    cache = HybridCache.allocate(g, 2)
    prints = _footprints(cache)
    kinds = g.model.layer_kinds
    state_page = torch.zeros(g.page_bytes, dtype=torch.bool)
    state_page[: g.state_page_bytes] = True
    for a, (addr_a, mask_a) in prints.items():
        # Attention covers whole pages; GDN covers [conv|ssm] of each page and never the padding.
        expected = torch.ones_like(mask_a) if kinds[a] is LayerKind.ATTENTION else state_page.repeat(2)
        assert torch.equal(mask_a, expected)
        assert addr_a == cache.raw(g.tensor_of(a)).data_ptr()
        for b, (addr_b, mask_b) in prints.items():
            if b <= a:
                continue
            if g.tensor_of(a) != g.tensor_of(b):
                assert addr_a != addr_b  # different tensors: disjoint storages, never a shared byte
            else:
                # Same tensor j: layer j of every group shares the page bytes (one block id belongs to one
                # group at a time). Two GDN layers on one tensor cover exactly the same bytes.
                assert addr_a == addr_b and (mask_a & mask_b).any()
                if kinds[a] is kinds[b] is LayerKind.GDN:
                    assert torch.equal(mask_a, mask_b)
    regions = sorted(cache.regions, key=lambda r: r.addr)
    assert all(x.addr + x.length <= y.addr for x, y in pairwise(regions))


def test_blocks_halves_and_segments_are_disjoint(tiny_model):
    g = RankGeometry(tiny_model, 1, options=CacheOptions(kernel_block_size=8, kv_layout=SPLIT))
    cache = HybridCache.allocate(g, 3)
    spans = []
    for b in range(3):
        spans += [cache.kv_range(3, b, k, h) for k in range(g.kernel_ratio) for h in (0, 1)]
    spans.sort()
    assert all(a + n <= c for (a, n), (c, _) in pairwise(spans))
    assert sum(n for _, n in spans) == 3 * g.page_bytes  # K/V halves tile the pages exactly
    state = sorted([cache.conv_range(0, b, s) for b in range(3) for s in ConvSegment] +
                   [cache.ssm_range(0, b) for b in range(3)])
    assert all(a + n <= c for (a, n), (c, _) in pairwise(state))
    assert sum(n for _, n in state) == 3 * g.state_page_bytes


# ---- wrapping existing tensors -----------------------------------------------------------------------

def test_wrap_vllm_shaped_tensors_aliases_them(tiny_model):
    g = RankGeometry(tiny_model, 1)
    given_tensors = [torch.zeros(4, g.page_bytes // 2, dtype=torch.bfloat16) for _ in range(g.num_tensors)]
    cache = HybridCache.wrap(g, given_tensors)
    assert cache.num_blocks == 4
    assert [r.addr for r in cache.regions] == [t.data_ptr() for t in given_tensors]
    as_int(cache.ssm(6)[2]).fill_(-1)
    raw = given_tensors[g.tensor_of(6)].view(torch.uint8)[2]
    assert bool((raw[g.conv_bytes : g.state_page_bytes] == 255).all())
    assert int(raw[: g.conv_bytes].sum()) == 0 and int(raw[g.state_page_bytes :].sum()) == 0


# ---- typed errors -----------------------------------------------------------------------------------

@pytest.mark.parametrize("num_blocks", [0, -1, -7])
def test_zero_or_negative_blocks(tiny_model, num_blocks):
    with pytest.raises(ConfigError, match=f"num_blocks={num_blocks}") as info:
        HybridCache.allocate(RankGeometry(tiny_model, 1), num_blocks)
    assert (info.value.field, info.value.value) == ("num_blocks", num_blocks)


@pytest.mark.parametrize("nbytes", [1023, 1025, 2 * 1024 + 512, 0])
def test_wrapped_tensor_of_wrong_size(tiny_model, nbytes):
    g = RankGeometry(tiny_model, 1)
    tensors = [torch.zeros(1024, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)]
    with pytest.raises(CacheShapeError, match=f"holds {nbytes} bytes") as info:
        HybridCache.wrap(g, tensors)
    assert (info.value.expected, info.value.actual) == (1024, nbytes)
    assert "page_bytes=1024" in str(info.value)


def test_wrapped_tensor_count_and_sizes(tiny_model):
    g = RankGeometry(tiny_model, 1)
    with pytest.raises(CacheShapeError, match="expected 2 shared tensors") as info:
        HybridCache.wrap(g, [torch.zeros(1024, dtype=torch.uint8)] * 3)
    assert (info.value.expected, info.value.actual) == (2, 3)
    with pytest.raises(CacheShapeError, match=r"\[1024, 2048\]"):
        HybridCache.wrap(g, [torch.zeros(1024, dtype=torch.uint8), torch.zeros(2048, dtype=torch.uint8)])
    with pytest.raises(CacheShapeError, match="not contiguous"):
        HybridCache.wrap(g, [torch.zeros(2, 2048, dtype=torch.uint8)[:, ::2]] * 2)
    with pytest.raises(CacheShapeError, match="list"):
        HybridCache.wrap(g, [[0] * 1024] * 2)  # type: ignore[list-item]


def test_view_of_wrong_kind_or_range(tiny_model):
    cache = HybridCache.allocate(RankGeometry(tiny_model, 1, options=CacheOptions(kernel_block_size=8,
                                                                                   kv_layout=SPLIT)), 2)
    with pytest.raises(ConfigError, match="layer 0 is linear_attention"):
        cache.kv(0)
    with pytest.raises(ConfigError, match="layer 3 is full_attention"):
        cache.conv(3)
    with pytest.raises(ConfigError, match="layer=8"):
        cache.ssm(8)
    with pytest.raises(ConfigError, match="block_id=2") as info:
        cache.ssm_range(0, 2)
    assert info.value.value == 2
    with pytest.raises(ConfigError, match="kernel_index=2") as info:
        cache.kv_range(3, 0, 2, 0)
    assert info.value.value == 2
    with pytest.raises(ConfigError, match="half=2"):
        cache.kv_range(3, 0, 0, 2)
    with pytest.raises(ConfigError, match="kernel_index=2"):
        cache.kernel_block_range(3, 0, 2)
    with pytest.raises(ConfigError, match="layer 0 is linear_attention"):
        cache.k(0)


def test_kv_range_needs_the_split_layout(tiny_model):
    cache = HybridCache.allocate(RankGeometry(tiny_model, 1), 2)
    with pytest.raises(ConfigError, match="split") as info:
        cache.kv_range(3, 0, 0, 0)
    assert (info.value.field, info.value.value) == ("kv_layout", "interleaved")
