"""Unsharded model shapes, read from the field names of a model's own config.json.

A Qwen3.5 config nests the language model under ``text_config``; a
Qwen3-Next config is flat. Both shapes are accepted.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.identity_enum import IdentityEnum


class LayerKind(IdentityEnum):
    ATTENTION = "full_attention"
    GDN = "linear_attention"


class DType(IdentityEnum):
    """Element types the cache may hold; value is the canonical name."""

    BF16 = "bfloat16"
    FP16 = "float16"
    FP32 = "float32"
    FP8 = "fp8_e4m3"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @classmethod
    def parse(cls, name: str, *, field: str = "dtype") -> DType:
        key = str(name).lower().removeprefix("torch.")
        try:
            return _ALIASES[key]
        except KeyError:
            raise ConfigError(
                f"{field}={name!r} is not a supported dtype "
                f"(bf16, fp16, fp32, fp8 and their torch names)",
                field=field,
                value=name,
            ) from None


_ITEMSIZE = {DType.BF16: 2, DType.FP16: 2, DType.FP32: 4, DType.FP8: 1}
_ALIASES = {
    "bfloat16": DType.BF16, "bf16": DType.BF16,
    "float16": DType.FP16, "fp16": DType.FP16, "half": DType.FP16,
    "float32": DType.FP32, "fp32": DType.FP32, "float": DType.FP32,
    "fp8": DType.FP8, "fp8_e4m3": DType.FP8, "float8_e4m3fn": DType.FP8,
}


class ModelSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Unsharded per-layer shapes of a hybrid (full attention + GDN) model."""

    name: str
    layer_kinds: tuple[LayerKind, ...]
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    dtype: DType
    ssm_dtype: DType

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.ATTENTION)

    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.GDN)

    @property
    def conv_dim(self) -> int:
        """Conv channels, ordered [Q | K | V] (not Mamba2's x|B|C)."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + (
            self.linear_num_value_heads * self.linear_value_head_dim
        )

    @property
    def conv_window(self) -> int:
        """Stored conv positions per channel: kernel width minus one (no speculative decoding)."""
        return self.linear_conv_kernel_dim - 1


_REQUIRED_ATTENTION = ("num_hidden_layers", "num_key_value_heads", "head_dim")
_REQUIRED_GDN = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)


def _positive_int(cfg: Mapping[str, Any], key: str, source: str) -> int:
    if key not in cfg:
        raise ConfigError(f"{source}: config is missing field {key!r}", field=key)
    value = cfg[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{source}: field {key!r}={value!r} must be a positive integer", field=key, value=value)
    return value


def _layer_kinds(cfg: Mapping[str, Any], num_layers: int, source: str) -> tuple[LayerKind, ...]:
    if "layer_types" in cfg:
        names = cfg["layer_types"]
        if not isinstance(names, list) or len(names) != num_layers:
            raise ConfigError(
                f"{source}: layer_types must list {num_layers} entries, got {names!r}",
                field="layer_types",
                value=names,
            )
        kinds = []
        for name in names:
            try:
                kinds.append(LayerKind(name))
            except ValueError:
                raise ConfigError(
                    f"{source}: layer type {name!r} is not supported "
                    f"(only 'full_attention' and 'linear_attention'; sliding-window and MLA are refused)",
                    field="layer_types",
                    value=name,
                ) from None
        return tuple(kinds)
    if "full_attention_interval" in cfg:
        interval = _positive_int(cfg, "full_attention_interval", source)
        return tuple(
            LayerKind.ATTENTION if (i + 1) % interval == 0 else LayerKind.GDN for i in range(num_layers)
        )
    raise ConfigError(
        f"{source}: config needs 'layer_types' or 'full_attention_interval'", field="layer_types"
    )


def model_from_config(config: Mapping[str, Any], *, name: str = "custom") -> ModelSpec:
    """Build a ModelSpec from a config.json dict (flat or nested under ``text_config``).

    Raises:
        ConfigError: a required field is missing or invalid; the field is named.
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"{name}: config must be a JSON object, got {type(config).__name__}")
    cfg = config.get("text_config", config)
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"{name}: text_config must be a JSON object", field="text_config")
    num_layers = _positive_int(cfg, "num_hidden_layers", name)
    kinds = _layer_kinds(cfg, num_layers, name)
    dims = {key: _positive_int(cfg, key, name) for key in _REQUIRED_ATTENTION[1:]}
    has_gdn = LayerKind.GDN in kinds
    gdn = {key: (_positive_int(cfg, key, name) if has_gdn or key in cfg else 1) for key in _REQUIRED_GDN}
    dtype_name = cfg.get("dtype", cfg.get("torch_dtype", config.get("dtype", config.get("torch_dtype"))))
    if dtype_name is None:
        raise ConfigError(f"{name}: config is missing field 'dtype' (or 'torch_dtype')", field="dtype")
    dtype = DType.parse(dtype_name, field="dtype")
    ssm_name = cfg.get("mamba_ssm_dtype")
    # Qwen3-Next has no mamba_ssm_dtype: the recurrent state then uses bf16 (docs/presets.md#table).
    ssm_dtype = DType.BF16 if ssm_name is None else DType.parse(ssm_name, field="mamba_ssm_dtype")
    if has_gdn and gdn["linear_num_value_heads"] % gdn["linear_num_key_heads"]:
        raise ConfigError(
            f"{name}: linear_num_value_heads={gdn['linear_num_value_heads']} is not a multiple of "
            f"linear_num_key_heads={gdn['linear_num_key_heads']}",
            field="linear_num_value_heads",
            value=gdn["linear_num_value_heads"],
        )
    if has_gdn and gdn["linear_conv_kernel_dim"] < 2:
        raise ConfigError(
            f"{name}: linear_conv_kernel_dim={gdn['linear_conv_kernel_dim']} leaves no conv state",
            field="linear_conv_kernel_dim",
            value=gdn["linear_conv_kernel_dim"],
        )
    if LayerKind.ATTENTION not in kinds:
        raise ConfigError(f"{name}: model has no full-attention layer", field="layer_types")
    return ModelSpec(
        name=name,
        layer_kinds=kinds,
        num_kv_heads=dims["num_key_value_heads"],
        head_dim=dims["head_dim"],
        linear_num_key_heads=gdn["linear_num_key_heads"],
        linear_num_value_heads=gdn["linear_num_value_heads"],
        linear_key_head_dim=gdn["linear_key_head_dim"],
        linear_value_head_dim=gdn["linear_value_head_dim"],
        linear_conv_kernel_dim=gdn["linear_conv_kernel_dim"],
        dtype=dtype,
        ssm_dtype=ssm_dtype,
    )


MAX_CONFIG_BYTES = 16 << 20  # a model's config.json is a few KiB


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A config.json as a dict.

    Raises:
        ConfigError: the path is missing, not a regular file, unreadable, larger than
            MAX_CONFIG_BYTES, not UTF-8, not JSON, nested too deeply to parse, or not a JSON object.
    """
    p = Path(path)

    def bad(why: str) -> ConfigError:
        return ConfigError(f"config file {str(p)!r} {why}", field="config", value=str(p))

    try:
        if not p.exists():
            raise bad("does not exist")
        if not p.is_file():
            raise bad("is not a file (a directory or a device?); pass the path of a config.json")
        if p.stat().st_size > MAX_CONFIG_BYTES:
            raise bad(f"is larger than {MAX_CONFIG_BYTES} bytes; a model config is a few KiB")
        raw = p.read_bytes()
    except OSError as exc:
        raise bad(f"cannot be read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad(f"is not UTF-8 text (byte {exc.start} is {raw[exc.start:exc.start + 1]!r})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad(f"is not valid JSON: {exc}") from exc
    except RecursionError:
        raise bad("is nested too deeply to be a model config") from None
    if not isinstance(data, dict):
        raise bad(f"must hold a JSON object, not a {type(data).__name__}")
    return data


def load_config_file(path: str | Path) -> ModelSpec:
    """Load a user's own config.json (errors as in ``read_config_file``)."""
    p = Path(path)
    return model_from_config(read_config_file(p), name=p.parent.name or p.stem)


def context_tokens(config: Mapping[str, Any]) -> int | None:
    """The longest sequence the model was built for (``max_position_embeddings``), or None when not stated."""
    cfg = config.get("text_config", config)
    value = cfg.get("max_position_embeddings", config.get("max_position_embeddings")) if isinstance(
        cfg, Mapping) else None
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"max_position_embeddings={value!r} must be a positive integer",
                          field="max_position_embeddings", value=value)
    return value
