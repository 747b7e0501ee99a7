"""Geometry from a live engine's numbers, checked against the registry; every disagreement named."""

from __future__ import annotations

import msgspec
import pytest

from hybrid_transfer.errors import ConfigError, EngineSpecMismatch
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    DType,
    KVLayout,
    LayerKind,
    RankGeometry,
    fingerprint_of,
    load_preset,
    preset_names,
)
from hybrid_transfer.layout.engine_spec import (
    EngineAttentionSpec,
    EngineGroup,
    EngineRankSpec,
    EngineStateSpec,
    engine_group_order,
    geometry_from_engine_spec,
    to_engine_group_order,
    to_our_group_order,
)

NUM_BLOCKS = 100


def _vllm_state_shapes(model, tp, conv_layout):
    """vLLM 0.33's gated_delta_net_state_shape, written out independently of the registry."""
    conv_dim = 2 * model.linear_num_key_heads * model.linear_key_head_dim + (
        model.linear_num_value_heads * model.linear_value_head_dim)
    conv = (conv_dim // tp, model.linear_conv_kernel_dim - 1)
    if conv_layout is ConvLayout.SD:
        conv = conv[::-1]
    return conv, (model.linear_num_value_heads // tp, model.linear_value_head_dim, model.linear_key_head_dim)


def _engine_order(model):
    """Groups as an engine lists them: GDN groups first (as vLLM did for a tiny Qwen3-Next), then attention."""
    groups = RankGeometry(model, 1).tensor_map.groups
    return tuple(EngineGroup(kind=g.kind, layers=tuple(reversed(g.layers)))
                 for g in sorted(groups, key=lambda g: g.kind is LayerKind.ATTENTION))


def _spec(model, tp, *, options=None, **changes):
    """What an engine reports for rank 0 of ``tp`` allocated as ``options`` says (page from its own formula)."""
    g = RankGeometry(model, tp, 0, options)
    heads = max(1, model.num_kv_heads // tp)
    kv_tok = 2 * heads * model.head_dim * g.kv_dtype.itemsize
    conv, ssm = _vllm_state_shapes(model, tp, g.conv_layout)
    fields = dict(
        attention=EngineAttentionSpec(num_kv_heads=heads, head_size=model.head_dim, dtype=g.kv_dtype.value,
                                      block_size=g.block_size, kernel_block_size=g.kernel_block_size),
        state=EngineStateSpec(conv_shape=conv, ssm_shape=ssm, conv_dtype=g.conv_dtype.value,
                              ssm_dtype="torch." + g.ssm_dtype.value),
        num_blocks=NUM_BLOCKS, page_size_bytes=g.block_size * kv_tok,
        layer_slots=g.tensor_map.layer_tensor, groups=_engine_order(model),
        kv_layout=g.options.kv_layout.value, conv_layout=g.conv_layout.value,
    )
    return EngineRankSpec(**(fields | changes))


def _tp_sizes(model):
    out = []
    for tp in (1, 2, 4, 8):
        try:
            RankGeometry(model, tp)
        except ConfigError:
            continue
        out.append(tp)
    return out


CASES = [(name, tp) for name in preset_names() for tp in _tp_sizes(load_preset(name))]


@pytest.mark.parametrize("name, tp", CASES)
def test_every_preset_round_trips_through_engine_specs(name, tp):
    model = load_preset(name)
    for rank in sorted({0, tp - 1}):
        ours = RankGeometry(model, tp, rank)
        spec = _spec(model, tp)
        rebuilt = geometry_from_engine_spec(model, tp, rank, spec)
        assert rebuilt.describe() == ours.describe()
        assert fingerprint_of(rebuilt) == fingerprint_of(ours)


def test_the_tiny_model_round_trips_with_split_pages_and_kernel_blocks(tiny_model):
    options = CacheOptions(block_size=32, kernel_block_size=16, kv_layout=KVLayout.SPLIT, conv_layout=ConvLayout.SD)
    ours = RankGeometry(tiny_model, 2, 1, options)
    rebuilt = geometry_from_engine_spec(tiny_model, 2, 1, _spec(tiny_model, 2, options=options))
    assert rebuilt.describe() == ours.describe() and fingerprint_of(rebuilt) == fingerprint_of(ours)
    assert rebuilt.kernel_ratio == 2


def test_the_engines_dtypes_win_and_reach_the_fingerprint(tiny_model):
    """The engine keeps conv state in fp32 and ssm in bf16, unlike the model config (bf16 / fp32)."""
    base = _spec(tiny_model, 1)
    state = msgspec.structs.replace(base.state, conv_dtype="float32", ssm_dtype="bfloat16")
    geometry = geometry_from_engine_spec(tiny_model, 1, 0, _spec(tiny_model, 1, state=state))
    assert (geometry.conv_dtype, geometry.ssm_dtype) == (DType.FP32, DType.BF16)
    fp = fingerprint_of(geometry)
    assert (fp.conv_dtype, fp.ssm_dtype) == ("float32", "bfloat16")
    assert fp != fingerprint_of(RankGeometry(tiny_model, 1))
    assert geometry.conv_bytes == 2 * RankGeometry(tiny_model, 1).conv_bytes


def _mismatch(model, tp, spec) -> EngineSpecMismatch:
    with pytest.raises(EngineSpecMismatch) as info:
        geometry_from_engine_spec(model, tp, 0, spec)
    assert isinstance(info.value, ConfigError)
    return info.value


@pytest.mark.parametrize("name, tp", [("qwen3.5-397b-a17b", 2), ("qwen3.5-0.8b", 1)])
def test_a_wrong_head_count_is_refused_by_name(name, tp):
    model = load_preset(name)
    spec = _spec(model, tp)
    wrong = msgspec.structs.replace(spec, attention=msgspec.structs.replace(spec.attention, num_kv_heads=2 * (
        spec.attention.num_kv_heads)))
    error = _mismatch(model, tp, wrong)
    assert "num_kv_heads" in error.fields and "num_kv_heads" in str(error)


@pytest.mark.parametrize("name, tp", [("qwen3.5-397b-a17b", 2), ("qwen3.5-0.8b", 1)])
def test_a_wrong_layer_to_slot_map_is_refused_by_name(name, tp):
    model = load_preset(name)
    spec = _spec(model, tp)
    slots = list(spec.layer_slots)
    slots[0], slots[-1] = slots[-1], slots[0]  # layer 0 sits on slot 0, the last layer on the last slot
    error = _mismatch(model, tp, msgspec.structs.replace(spec, layer_slots=tuple(slots)))
    assert error.fields == ("layer_slots",)
    assert error.differences[0][1] == tuple(slots)


@pytest.mark.parametrize("name, tp", [("qwen3.5-397b-a17b", 2), ("qwen3.5-0.8b", 1)])
def test_a_wrong_page_size_is_refused_by_name(name, tp):
    model = load_preset(name)
    spec = _spec(model, tp)
    error = _mismatch(model, tp, msgspec.structs.replace(spec, page_size_bytes=spec.page_size_bytes + 4096))
    assert error.fields == ("page_size",)
    assert error.differences[0][1:] == (spec.page_size_bytes + 4096, spec.page_size_bytes)


def test_every_disagreement_is_named_at_once(tiny_model):
    spec = _spec(tiny_model, 1)
    wrong = msgspec.structs.replace(
        spec,
        attention=msgspec.structs.replace(spec.attention, num_kv_heads=1, head_size=16),
        state=msgspec.structs.replace(spec.state, conv_shape=spec.state.conv_shape[::-1], ssm_shape=(8, 4, 5)),
        layer_slots=(1,) + spec.layer_slots[1:],
        groups=spec.groups[:-1],
        page_size_bytes=spec.page_size_bytes - 2,
    )
    error = _mismatch(tiny_model, 1, wrong)
    assert error.fields == ("num_kv_heads", "head_size", "conv_shape", "ssm_shape", "layer_slots", "groups",
                            "page_size")


def test_a_hybrid_without_state_is_refused(tiny_model):
    assert _mismatch(tiny_model, 1, _spec(tiny_model, 1, state=None)).fields == ("state",)


def test_a_block_size_too_small_for_the_state_is_named(tiny_model):
    spec = _spec(tiny_model, 1)
    small = msgspec.structs.replace(spec.attention, block_size=8, kernel_block_size=None)
    error = _mismatch(tiny_model, 1, msgspec.structs.replace(spec, attention=small))
    assert error.fields == ("block_size",)


def test_engine_group_order_maps_the_engines_order_to_ours(tiny_model):
    tensor_map = RankGeometry(tiny_model, 1).tensor_map
    engine = _engine_order(tiny_model)  # G, G, G, A
    order = engine_group_order(tensor_map, engine)
    assert order == (3, 0, 1, 2)
    assert [engine[j].kind for j in order] == [g.kind for g in tensor_map.groups]
    assert to_our_group_order(([1], [2], [3], [4, 5, 6]), order) == ((4, 5, 6), (1,), (2,), (3,))
    assert to_engine_group_order(((4, 5, 6), (1,), (2,), (3,)), order) == ((1,), (2,), (3,), (4, 5, 6))
    assert engine_group_order(tensor_map, [EngineGroup(g.kind, g.layers) for g in tensor_map.groups]) == (0, 1, 2, 3)
    with pytest.raises(ConfigError) as info:
        engine_group_order(tensor_map, engine[:2] + (EngineGroup(LayerKind.GDN, (0, 1)), engine[3]))
    assert info.value.field == "groups"
    with pytest.raises(ConfigError):
        to_our_group_order(([1], [2]), order)


def test_strings_are_coerced_and_bad_ones_refused_by_name():
    assert EngineAttentionSpec(2, 8, "torch.bfloat16", 16).dtype is DType.BF16
    assert EngineGroup("linear_attention", (0,)).kind is LayerKind.GDN
    with pytest.raises(ConfigError) as info:
        EngineAttentionSpec(2, 8, "int4", 16)
    assert info.value.field == "dtype"
    with pytest.raises(ConfigError) as info:
        EngineStateSpec((4, 3), (2, 4, 4), "bfloat16", "float64")
    assert info.value.field == "ssm_dtype"
