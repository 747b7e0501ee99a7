"""Per-slot tensors carved out of one engine-style allocation alias it: no copy, every byte shared."""

from __future__ import annotations

import pytest
import torch

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.cache_slots import backing_bytes, carve_slots, slots_from_layer_views
from hybrid_transfer.errors import CacheShapeError
from hybrid_transfer.layout import LayerKind, RankGeometry

NUM_BLOCKS = 8


def _engine_views(geometry: RankGeometry, *, offset: int = 0, gap: int = 0):
    """Per-layer views over one int8 buffer the way vLLM 0.33's allocate_kv_cache lays them out:
    slot j at offset + j * layer_stride; attention as [blocks, heads, tokens, 2 * head_dim] of the
    KV dtype, GDN as int8 [blocks, 1, 1, real state bytes] with the page as block stride."""
    page, slots = geometry.page_bytes, geometry.num_tensors
    slot_bytes = NUM_BLOCKS * page
    stride = slot_bytes + gap
    buffer = torch.zeros(offset + slots * stride, dtype=torch.int8)
    views = {}
    for layer, kind in enumerate(geometry.model.layer_kinds):
        start = offset + geometry.tensor_of(layer) * stride
        if kind is LayerKind.ATTENTION:
            typed = buffer.view(torch.bfloat16)
            h, n, d = geometry.num_kv_heads_local, geometry.block_size, geometry.model.head_dim
            views[layer] = typed.as_strided((NUM_BLOCKS, h, n, 2 * d), (page // 2, n * 2 * d, 2 * d, 1), start // 2)
        else:
            views[layer] = buffer.as_strided((NUM_BLOCKS, 1, 1, geometry.state_page_bytes),
                                             (page, geometry.state_page_bytes, geometry.state_page_bytes, 1), start)
    return buffer, views, slot_bytes, stride


def test_slots_from_layer_views_alias_the_engine_buffer(tiny_model):
    geometry = RankGeometry(tiny_model, 1)
    buffer, views, slot_bytes, _ = _engine_views(geometry, offset=512)
    slots = slots_from_layer_views(views, geometry.tensor_map.layer_tensor, slot_bytes)
    cache = HybridCache.wrap(geometry, slots)
    assert cache.num_blocks == NUM_BLOCKS
    for layer, view in views.items():
        assert cache.raw(geometry.tensor_of(layer)).data_ptr() == view.data_ptr()
    # A write through the engine's view is a write to the wrapped cache, and back.
    views[3][5, 1, 2, 0] = 1.5  # attention layer 3, block 5, head 1, token 2
    page = cache.raw(geometry.tensor_of(3))[5].view(torch.bfloat16)
    assert page[1 * geometry.block_size * 2 * geometry.model.head_dim + 2 * 2 * geometry.model.head_dim] == 1.5
    cache.raw(geometry.tensor_of(4))[2, :4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert views[4][2, 0, 0, :4].tolist() == [1, 2, 3, 4]
    assert backing_bytes(views[7]).data_ptr() == buffer.data_ptr()


def test_the_engines_attention_view_and_ours_agree_on_every_k_and_v(tiny_model):
    """vLLM 0.33 splits its [blocks, heads, tokens, 2 * head_dim] view as K = [..., :d], V = [..., d:]."""
    geometry = RankGeometry(tiny_model, 1)
    _, views, slot_bytes, _ = _engine_views(geometry)
    cache = HybridCache.wrap(geometry, slots_from_layer_views(views, geometry.tensor_map.layer_tensor, slot_bytes))
    d = geometry.model.head_dim
    for layer in geometry.model.attention_layers:
        engine = views[layer]
        engine.copy_(torch.randn(engine.shape).to(engine.dtype))
        assert torch.equal(cache.k(layer), engine[..., :d]) and torch.equal(cache.v(layer), engine[..., d:])
        assert torch.equal(cache.kv(layer), engine)


def test_carve_slots_by_numbers_matches_the_views(tiny_model):
    geometry = RankGeometry(tiny_model, 1)
    buffer, views, slot_bytes, stride = _engine_views(geometry, offset=256, gap=1024)
    carved = carve_slots(buffer, geometry.num_tensors, slot_bytes, offset=256, layer_stride=stride)
    from_views = slots_from_layer_views(views, geometry.tensor_map.layer_tensor, slot_bytes)
    assert [t.data_ptr() for t in carved] == [t.data_ptr() for t in from_views]
    assert all(t.numel() == slot_bytes and t.dtype == torch.uint8 and t.is_contiguous() for t in carved)


@pytest.mark.parametrize("kwargs", [
    dict(num_slots=2, slot_bytes=100, layer_stride=50),  # overlap
    dict(num_slots=3, slot_bytes=100),  # past the end of 256 bytes
    dict(num_slots=0, slot_bytes=100),
    dict(num_slots=1, slot_bytes=100, offset=-1),
])
def test_carve_slots_refuses_impossible_placements(kwargs):
    with pytest.raises(CacheShapeError):
        carve_slots(torch.zeros(256, dtype=torch.int8), **kwargs)


def test_layer_views_that_do_not_line_up_are_refused(tiny_model):
    geometry = RankGeometry(tiny_model, 1)
    _, views, slot_bytes, _ = _engine_views(geometry)
    layer_slots = list(geometry.tensor_map.layer_tensor)
    with pytest.raises(CacheShapeError, match="no view"):
        slots_from_layer_views({k: v for k, v in views.items() if k != 5}, layer_slots, slot_bytes)
    with pytest.raises(CacheShapeError, match="spans"):
        slots_from_layer_views(views, layer_slots, slot_bytes * 2)
    wrong = list(layer_slots)
    wrong[0] = 1 - wrong[0]  # layer 0 claimed on the other slot: starts disagree there
    with pytest.raises(CacheShapeError, match="start at bytes"):
        slots_from_layer_views(views, wrong, slot_bytes)
    other = dict(views)
    other[2] = torch.zeros_like(views[2])
    with pytest.raises(CacheShapeError, match="allocation"):
        slots_from_layer_views(other, layer_slots, slot_bytes)
