"""The six shipped presets match the table of docs/presets.md#table."""

from __future__ import annotations

import pytest

from hybrid_transfer.errors import ConfigError, UnknownPresetError
from hybrid_transfer.layout import DType, LayerKind, load_preset, preset_names

# preset: (layers, FA, GDN, K, head_dim, nk, nv, ssm dtype), docs/presets.md#table
TABLE = {
    "qwen3-next-80b-a3b": (48, 12, 36, 2, 256, 16, 32, DType.BF16),
    "qwen3.5-397b-a17b": (60, 15, 45, 2, 256, 16, 64, DType.FP32),
    "qwen3.5-35b-a3b": (40, 10, 30, 2, 256, 16, 32, DType.FP32),
    "qwen3.5-27b": (64, 16, 48, 4, 256, 16, 48, DType.FP32),
    "qwen3.5-4b": (32, 8, 24, 4, 256, 16, 32, DType.FP32),
    "qwen3.5-0.8b": (24, 6, 18, 2, 256, 16, 16, DType.FP32),
}


def test_preset_names_are_the_six_models():
    assert preset_names() == tuple(sorted(TABLE))


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_matches_design_table(name):
    layers, fa, gdn, k, head_dim, nk, nv, ssm_dtype = TABLE[name]
    m = load_preset(name)
    assert m.name == name
    assert (m.num_layers, len(m.attention_layers), len(m.gdn_layers)) == (layers, fa, gdn)
    assert (m.num_kv_heads, m.head_dim) == (k, head_dim)
    assert (m.linear_num_key_heads, m.linear_num_value_heads) == (nk, nv)
    assert (m.linear_key_head_dim, m.linear_value_head_dim) == (128, 128)
    assert m.linear_conv_kernel_dim == 4
    assert m.dtype is DType.BF16
    assert m.ssm_dtype is ssm_dtype


@pytest.mark.parametrize("name", sorted(TABLE))
def test_preset_layer_i_is_attention_iff_i_plus_one_divisible_by_four(name):
    m = load_preset(name)
    assert m.layer_kinds == tuple(
        LayerKind.ATTENTION if (i + 1) % 4 == 0 else LayerKind.GDN for i in range(m.num_layers)
    )


def test_unknown_preset_is_typed_and_names_value():
    with pytest.raises(UnknownPresetError, match="qwen9-huge") as info:
        load_preset("qwen9-huge")
    assert isinstance(info.value, ConfigError)
    assert info.value.name == "qwen9-huge"
    assert info.value.value == "qwen9-huge"
    assert info.value.known == preset_names()
    assert "qwen3.5-397b-a17b" in str(info.value)
