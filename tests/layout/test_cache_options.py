"""CacheOptions validates its fields: plain strings become enums, anything else is refused by name."""

from __future__ import annotations

import msgspec
import pytest

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import CacheOptions, ConvLayout, DType, KVLayout, RankGeometry, SsmOrder, load_preset


def test_defaults_are_vllm_033():
    o = CacheOptions()
    assert o.kv_layout is KVLayout.INTERLEAVED
    assert o.conv_layout is ConvLayout.DS
    assert (o.kv_dtype, o.ssm_dtype, o.block_size, o.kernel_block_size) == (None, None, None, None)


def test_kv_layout_members_and_values():
    assert [(m.name, m.value) for m in KVLayout] == [("SPLIT", "split"), ("INTERLEAVED", "interleaved")]


@pytest.mark.parametrize(("field", "given", "want"), [
    ("conv_layout", "DS", ConvLayout.DS),
    ("conv_layout", "SD", ConvLayout.SD),
    ("conv_layout", "sd", ConvLayout.SD),
    ("kv_layout", "split", KVLayout.SPLIT),
    ("kv_layout", "interleaved", KVLayout.INTERLEAVED),
    ("kv_layout", "INTERLEAVED", KVLayout.INTERLEAVED),
    ("ssm_order", "nv,dk,dv", SsmOrder.V_K_D),
    ("ssm_order", "V_D_K", SsmOrder.V_D_K),
    ("kv_dtype", "fp8", DType.FP8),
    ("kv_dtype", "bf16", DType.BF16),
    ("kv_dtype", "torch.float16", DType.FP16),
    ("ssm_dtype", "float32", DType.FP32),
])
def test_strings_are_coerced_to_enums(field, given, want):
    assert getattr(CacheOptions(**{field: given}), field) is want


def test_numpy_integers_become_ints():
    import numpy as np

    o = CacheOptions(block_size=np.int64(544), kernel_block_size=np.int32(16), alignment=np.int64(16))
    assert (o.block_size, o.kernel_block_size, o.alignment) == (544, 16, 16)
    assert all(type(v) is int for v in (o.block_size, o.kernel_block_size, o.alignment))


def test_sd_string_gives_an_sd_view_not_a_ds_one():
    """The bug this guards: a string compared against the enum silently took the DS branch."""
    g = RankGeometry(load_preset("qwen3.5-0.8b"), 1, options=CacheOptions(conv_layout="SD"))
    assert g.conv_layout is ConvLayout.SD
    with pytest.raises(ConfigError, match="DS"):
        g.conv_segment_offset(0, 0)


@pytest.mark.parametrize(("field", "value"), [
    ("conv_layout", "XY"),
    ("conv_layout", 3),
    ("kv_layout", "blocked"),
    ("kv_layout", None),
    ("ssm_order", "dk,dv"),
    ("kv_dtype", "int4"),
    ("kv_dtype", 8),
    ("ssm_dtype", "fp64"),
    ("alignment", "16"),
    ("alignment", True),
    ("block_size", 16.0),
    ("kernel_block_size", "16"),
])
def test_bad_values_are_refused_by_name(field, value):
    with pytest.raises(ConfigError, match=field) as info:
        CacheOptions(**{field: value})
    assert (info.value.field, info.value.value) == (field, value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", ["HND", "LBHNC"])
def test_vllm_layout_names_are_refused_with_a_hint(value):
    with pytest.raises(ConfigError, match="interleaved") as info:
        CacheOptions(kv_layout=value)
    assert info.value.value == value


def test_decoding_coerces_and_round_trips():
    raw = msgspec.json.encode(CacheOptions(kv_layout=KVLayout.SPLIT, kv_dtype=DType.FP8))
    back = msgspec.json.decode(raw, type=CacheOptions)
    assert (back.kv_layout, back.kv_dtype) == (KVLayout.SPLIT, DType.FP8)
