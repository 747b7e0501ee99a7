"""MTP's cache (docs/layout.md#draft-layers): draft attention layers after the model's, conv windows widened by
the speculative slots, and what follows from them: tensors, page-size unification, views, wire fields, refusals."""

from __future__ import annotations

import copy
import math

import msgspec
import numpy as np
import pytest
import torch
from tiny_model import TINY_CONFIG

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError, EngineSpecMismatch, FingerprintMismatch
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    LayerKind,
    RankGeometry,
    fingerprint_diff,
    fingerprint_of,
    load_preset,
    model_from_config,
)
from hybrid_transfer.layout.engine_spec import (
    EngineAttentionSpec,
    EngineGroup,
    EngineRankSpec,
    EngineStateSpec,
    engine_group_order,
    geometry_from_engine_spec,
)
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor, describe_rank, geometry_from_descriptor
from hybrid_transfer.plan.scenario import fake_engine

MTP = CacheOptions(draft_layers=1, speculative_slots=1)


@pytest.fixture(scope="module")
def tiny4():
    """The measured tiny Qwen3-Next: 4 layers, L0-L2 GDN, L3 attention."""
    cfg = copy.deepcopy(TINY_CONFIG)
    cfg["num_hidden_layers"] = 4
    return model_from_config(cfg, name="tiny4")


@pytest.mark.parametrize("field", ["draft_layers", "speculative_slots"])
@pytest.mark.parametrize("bad", [-1, 1.0, True, "1", None])
def test_options_refuse_anything_but_a_non_negative_int_naming_the_field(field, bad):
    with pytest.raises(ConfigError, match=field) as info:
        CacheOptions(**{field: bad})
    assert info.value.field == field and info.value.value == bad


def test_options_take_numpy_integers_as_plain_ints():
    o = CacheOptions(draft_layers=np.int64(2), speculative_slots=np.int32(1))
    assert type(o.draft_layers) is int and type(o.speculative_slots) is int
    assert msgspec.json.decode(msgspec.json.encode(o), type=CacheOptions) == o


def test_zero_is_the_geometry_of_before(tiny_model):
    for tp in (1, 2):
        a = RankGeometry(tiny_model, tp, 0)
        b = RankGeometry(tiny_model, tp, 0, CacheOptions(draft_layers=0, speculative_slots=0))
        assert a.describe() == b.describe()
        assert fingerprint_of(a) == fingerprint_of(b)
        assert "draft_layers" not in a.describe()


@pytest.mark.parametrize("slots", [0, 1, 2, 5])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_conv_window_widens_by_the_slots_and_unification_follows(tiny_model, slots, tp):
    m = tiny_model
    g = RankGeometry(m, tp, 0, CacheOptions(speculative_slots=slots))
    base = RankGeometry(m, tp, 0)
    window = m.linear_conv_kernel_dim - 1 + slots
    assert g.conv_window == window and m.conv_window == m.linear_conv_kernel_dim - 1
    conv_dim = 2 * m.linear_num_key_heads * m.linear_key_head_dim + m.linear_num_value_heads * m.linear_value_head_dim
    assert g.conv_bytes == conv_dim // tp * window * g.conv_itemsize
    assert g.conv_segment_bytes == tuple(s * window // (m.linear_conv_kernel_dim - 1) for s in base.conv_segment_bytes)
    assert g.ssm_bytes == base.ssm_bytes
    a, tok = g.options.alignment, g.kv_bytes_per_token
    assert g.block_size == a * math.ceil((g.conv_bytes + g.ssm_bytes) / (a * tok))
    assert g.page_bytes == g.block_size * tok


def test_draft_layers_are_attention_layers_after_the_models(tiny4):
    g = RankGeometry(tiny4, 1, 0, CacheOptions(draft_layers=2))
    assert g.cached_layers()[4:] == ((4, LayerKind.ATTENTION), (5, LayerKind.ATTENTION))
    assert g.num_attention_layers == len(tiny4.attention_layers) + 2
    assert g.layer_kind(5) is LayerKind.ATTENTION
    with pytest.raises(ConfigError, match="layer=6"):
        g.layer_kind(6)
    assert tiny4.num_layers == 4 and g.state_bytes_per_request == 3 * g.state_page_bytes


@pytest.mark.parametrize("conv_layout", list(ConvLayout))
def test_views_reach_the_draft_layer_and_the_widened_conv(tiny4, conv_layout):
    g = RankGeometry(tiny4, 1, 0, CacheOptions(draft_layers=1, speculative_slots=2, conv_layout=conv_layout))
    cache = HybridCache.allocate(g, 3)
    assert cache.conv(0).shape == (3, g.conv_dim_local, tiny4.linear_conv_kernel_dim - 1 + 2)
    # The draft layer (cached layer 4) is on tensor 1 of the attention group; its K is bytes of that tensor only.
    assert g.tensor_of(4) == 1
    cache.k(4)[1].fill_(1.0)
    assert cache.raw(0).count_nonzero() == 0
    lo, n = g.kv_offset(1, 0, 0), g.kernel_block_bytes
    assert cache.raw(1)[1].count_nonzero() > 0 and cache.raw(1).view(-1)[:lo].count_nonzero() == 0
    assert cache.raw(1).view(-1)[lo + n:].count_nonzero() == 0
    # Conv position w-1+1 (scratch) of channel 2 is its own element.
    cache.conv(1)[2, 5, tiny4.linear_conv_kernel_dim].fill_(1.0)
    assert cache.raw(0)[2].count_nonzero() == 2 and cache.raw(1).count_nonzero() > 0  # bf16: 2 bytes
    with pytest.raises(ConfigError, match="layer 4 is full_attention"):
        cache.conv(4)


def test_a_fingerprint_names_both_fields_and_the_map(tiny4):
    a = fingerprint_of(RankGeometry(tiny4, 1))
    b = fingerprint_of(RankGeometry(tiny4, 1, 0, MTP))
    names = [name for name, _, _ in fingerprint_diff(a, b)]
    assert names == ["layer_tensor", "draft_layers", "speculative_slots"]
    assert a.digest() != b.digest()
    assert fingerprint_diff(b, fingerprint_of(RankGeometry(tiny4, 1, 0, MTP))) == []


def test_a_descriptor_carries_both_fields_and_rebuilds_the_geometry(tiny4):
    g = RankGeometry(tiny4, 2, 1, MTP)
    desc = describe_rank(g, [1 << 32, 2 << 32], 10)
    assert (desc.draft_layers, desc.speculative_slots) == (1, 1)
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(desc), type=RankDescriptor)
    back = geometry_from_descriptor(tiny4, wire)
    assert back.describe() == g.describe() and back.tensor_map == g.tensor_map
    # A descriptor of before decodes with both fields zero.
    old = {k: v for k, v in msgspec.to_builtins(describe_rank(RankGeometry(tiny4, 1), [1 << 32], 10)).items()
           if k not in ("draft_layers", "speculative_slots")}
    assert msgspec.convert(old, RankDescriptor).draft_layers == 0


@pytest.mark.parametrize("field,local,remote", [
    ("draft_layers", CacheOptions(draft_layers=1), CacheOptions()),
    ("speculative_slots", CacheOptions(speculative_slots=2), CacheOptions(speculative_slots=1)),
    ("draft_layers", CacheOptions(), CacheOptions(draft_layers=2)),
])
def test_the_planner_refuses_sides_that_differ_naming_the_field_and_both_values(tiny4, field, local, remote):
    decode = fake_engine(tiny4, 1, local, 20)
    prefill = fake_engine(tiny4, 2, remote, 20, engine_index=1)
    with pytest.raises(FingerprintMismatch, match=field) as info:
        Planner(tiny4, decode[0], prefill)
    assert info.value.differences == ((field, getattr(local, field), getattr(remote, field)),)


def _engine(model, tp, options, conv_window):
    """An engine's report of rank 0: conv shape with the window it says, page from vLLM's own formula."""
    g = RankGeometry(model, tp, 0, options)
    heads = max(1, model.num_kv_heads // tp)
    kv_tok = 2 * heads * model.head_dim * g.kv_dtype.itemsize
    conv_dim = 2 * model.linear_num_key_heads * model.linear_key_head_dim + (
        model.linear_num_value_heads * model.linear_value_head_dim)
    groups = tuple(EngineGroup(kind=k.kind, layers=k.layers) for k in reversed(g.tensor_map.groups))
    return EngineRankSpec(
        attention=EngineAttentionSpec(num_kv_heads=heads, head_size=model.head_dim, dtype=g.kv_dtype.value,
                                      block_size=g.block_size),
        state=EngineStateSpec(conv_shape=(conv_dim // tp, conv_window),
                              ssm_shape=(model.linear_num_value_heads // tp, model.linear_value_head_dim,
                                         model.linear_key_head_dim), conv_dtype=g.conv_dtype.value,
                              ssm_dtype=g.ssm_dtype.value),
        num_blocks=50, page_size_bytes=g.block_size * kv_tok, layer_slots=g.tensor_map.layer_tensor, groups=groups,
        kv_layout=g.kv_layout.value, draft_layers=options.draft_layers, speculative_slots=options.speculative_slots)


@pytest.mark.parametrize("tp", [1, 2])
def test_an_engine_with_mtp_is_accepted_with_the_widened_conv_and_its_group_order(tp):
    model = load_preset("qwen3-next-80b-a3b")
    options = CacheOptions(draft_layers=1, speculative_slots=2)
    spec = _engine(model, tp, options, model.linear_conv_kernel_dim - 1 + 2)
    g = geometry_from_engine_spec(model, tp, 0, spec)
    assert g.describe() == RankGeometry(model, tp, 0, msgspec.structs.replace(
        options, block_size=g.block_size)).describe()
    order = engine_group_order(g.tensor_map, spec.groups)
    assert [spec.groups[j].layers for j in order] == [grp.layers for grp in g.tensor_map.groups]
    assert 48 in spec.groups[order[0]].layers


def test_an_engine_whose_conv_window_lacks_the_slots_is_refused_naming_the_shape():
    model = load_preset("qwen3-next-80b-a3b")
    spec = _engine(model, 1, CacheOptions(draft_layers=1, speculative_slots=1), model.linear_conv_kernel_dim - 1)
    with pytest.raises(EngineSpecMismatch) as info:
        geometry_from_engine_spec(model, 1, 0, spec)
    assert [d[0] for d in info.value.differences] == ["conv_shape"]
    conv_dim = model.conv_dim
    assert info.value.differences[0][2] == (conv_dim, model.linear_conv_kernel_dim)


def test_an_engine_missing_the_draft_layer_in_its_groups_is_refused():
    model = load_preset("qwen3-next-80b-a3b")
    spec = _engine(model, 1, MTP, model.linear_conv_kernel_dim)
    without = tuple(EngineGroup(kind=g.kind, layers=tuple(x for x in g.layers if x < 48)) for g in spec.groups)
    with pytest.raises(EngineSpecMismatch) as info:
        geometry_from_engine_spec(model, 1, 0, msgspec.structs.replace(spec, groups=without))
    assert [d[0] for d in info.value.differences] == ["groups"]


def test_padded_tensor_slots_stay_untouched_by_the_oracle_writes(tiny4):
    """verify.fill_source marks a padded group's pages on its empty tensors; expected_destination leaves them poison."""
    from hybrid_transfer.verify import POISON_BYTE, RequestLayout, expected_destination, fill_source, poison
    g = RankGeometry(tiny4, 1, 0, MTP)
    cache = HybridCache.allocate(g, 8)
    poison(cache)
    req = RequestLayout(block_ids=((0, 1), (2,), (3,)), num_tokens=20)
    fill_source(cache, req, 7)
    assert (cache.raw(1)[3] != POISON_BYTE).all()  # gdn[1] (layer 1) has nothing on tensor 1: marked whole
    want = expected_destination(cache, req, 7)
    assert (want[1].view(8, -1)[3] == POISON_BYTE).all()
    assert (want[0].view(8, -1)[3] != POISON_BYTE).any()
    assert torch.equal(want[1].view(8, -1)[5], torch.full_like(want[1].view(8, -1)[5], POISON_BYTE))
