"""ModelSpec from config.json dicts: both config shapes, both dtype keys, both layer-kind keys, typed errors."""

from __future__ import annotations

import json

import pytest

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import DType, LayerKind, load_config_file, model_from_config

REQUIRED = (
    "num_hidden_layers",
    "num_key_value_heads",
    "head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _layer_types(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def test_flat_config_fields(tiny_config):
    m = model_from_config(tiny_config, name="tiny")
    assert m.name == "tiny"
    assert m.num_layers == 8
    assert m.attention_layers == (3, 7)
    assert m.gdn_layers == (0, 1, 2, 4, 5, 6)
    assert (m.num_kv_heads, m.head_dim) == (2, 8)
    assert (m.linear_num_key_heads, m.linear_num_value_heads) == (4, 8)
    assert (m.linear_key_head_dim, m.linear_value_head_dim, m.linear_conv_kernel_dim) == (4, 4, 4)
    assert m.dtype is DType.BF16 and m.ssm_dtype is DType.FP32
    assert m.conv_dim == 2 * 4 * 4 + 8 * 4
    assert m.conv_window == 3


def test_nested_text_config_equals_flat(tiny_config):
    flat = model_from_config(tiny_config, name="x")
    nested = model_from_config({"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": tiny_config},
                               name="x")
    assert nested == flat


def test_dtype_may_sit_beside_text_config(tiny_config):
    dtype = tiny_config.pop("dtype")
    assert model_from_config({"text_config": tiny_config, "dtype": dtype}).dtype is DType.BF16


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
@pytest.mark.parametrize(("name", "expected"), [("bfloat16", DType.BF16), ("float16", DType.FP16),
                                                 ("torch.float32", DType.FP32)])
def test_dtype_and_torch_dtype(tiny_config, key, name, expected):
    tiny_config.pop("dtype")
    tiny_config[key] = name
    assert model_from_config(tiny_config).dtype is expected


def test_layer_types_equals_full_attention_interval(tiny_config):
    by_interval = model_from_config(tiny_config)
    tiny_config.pop("full_attention_interval")
    tiny_config["layer_types"] = _layer_types(8, 4)
    assert model_from_config(tiny_config) == by_interval


def test_interval_rule_is_i_plus_one_mod_interval(tiny_config):
    tiny_config["full_attention_interval"] = 2
    m = model_from_config(tiny_config)
    assert m.layer_kinds == tuple(LayerKind.ATTENTION if (i + 1) % 2 == 0 else LayerKind.GDN for i in range(8))


def test_missing_mamba_ssm_dtype_means_bf16(tiny_config):
    tiny_config.pop("mamba_ssm_dtype")
    assert model_from_config(tiny_config).ssm_dtype is DType.BF16


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "text_config"])
@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field_is_named(tiny_config, field, nested):
    tiny_config.pop(field)
    cfg = {"text_config": tiny_config} if nested else tiny_config
    with pytest.raises(ConfigError, match=field) as info:
        model_from_config(cfg)
    assert info.value.field == field


@pytest.mark.parametrize("nested", [False, True], ids=["flat", "text_config"])
def test_missing_dtype_is_named(tiny_config, nested):
    tiny_config.pop("dtype")
    cfg = {"text_config": tiny_config} if nested else tiny_config
    with pytest.raises(ConfigError, match="dtype") as info:
        model_from_config(cfg)
    assert info.value.field == "dtype"


def test_missing_layer_kinds_is_named(tiny_config):
    tiny_config.pop("full_attention_interval")
    with pytest.raises(ConfigError, match="layer_types") as info:
        model_from_config(tiny_config)
    assert info.value.field == "layer_types"


@pytest.mark.parametrize("bad", [0, -4, "8", 2.5, True, None])
def test_non_positive_or_non_int_field_names_value(tiny_config, bad):
    tiny_config["head_dim"] = bad
    with pytest.raises(ConfigError, match="head_dim") as info:
        model_from_config(tiny_config)
    assert info.value.field == "head_dim"
    assert info.value.value == bad
    assert repr(bad) in str(info.value)


def test_unknown_dtype_names_value(tiny_config):
    tiny_config["dtype"] = "int4"
    with pytest.raises(ConfigError, match="int4") as info:
        model_from_config(tiny_config)
    assert info.value.value == "int4"


def test_unsupported_layer_type_names_it(tiny_config):
    tiny_config.pop("full_attention_interval")
    tiny_config["layer_types"] = _layer_types(8, 4)
    tiny_config["layer_types"][0] = "sliding_attention"
    with pytest.raises(ConfigError, match="sliding_attention"):
        model_from_config(tiny_config)


def test_layer_types_of_wrong_length(tiny_config):
    tiny_config.pop("full_attention_interval")
    tiny_config["layer_types"] = _layer_types(7, 4)
    with pytest.raises(ConfigError, match="layer_types") as info:
        model_from_config(tiny_config)
    assert info.value.field == "layer_types"


def test_value_heads_must_be_multiple_of_key_heads(tiny_config):
    tiny_config["linear_num_value_heads"] = 6
    with pytest.raises(ConfigError, match="linear_num_value_heads=6") as info:
        model_from_config(tiny_config)
    assert info.value.value == 6


def test_conv_kernel_of_one_leaves_no_state(tiny_config):
    tiny_config["linear_conv_kernel_dim"] = 1
    with pytest.raises(ConfigError, match="linear_conv_kernel_dim=1"):
        model_from_config(tiny_config)


def test_model_without_attention_is_refused(tiny_config):
    tiny_config["full_attention_interval"] = 9
    with pytest.raises(ConfigError, match="no full-attention layer"):
        model_from_config(tiny_config)


def test_config_must_be_an_object():
    with pytest.raises(ConfigError, match="list"):
        model_from_config([1, 2])  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "expected"), [
    ("bf16", DType.BF16), ("BFloat16", DType.BF16), ("half", DType.FP16), ("fp32", DType.FP32),
    ("float8_e4m3fn", DType.FP8), ("fp8", DType.FP8),
])
def test_dtype_aliases(name, expected):
    assert DType.parse(name) is expected


def test_dtype_itemsizes():
    assert [DType.BF16.itemsize, DType.FP16.itemsize, DType.FP32.itemsize, DType.FP8.itemsize] == [2, 2, 4, 1]


def test_load_config_file_nested(tmp_path, tiny_config):
    path = tmp_path / "my-model" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps({"text_config": tiny_config}))
    m = load_config_file(path)
    assert m.name == "my-model"
    assert m == model_from_config(tiny_config, name="my-model")


def test_load_config_file_missing_names_path(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(ConfigError, match="absent.json") as info:
        load_config_file(path)
    assert info.value.value == str(path)


def test_load_config_file_bad_json_names_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON") as info:
        load_config_file(path)
    assert info.value.value == str(path)
