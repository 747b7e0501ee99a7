"""Arguments several subcommands share: which model, which KV dtype, which KV layout."""

from __future__ import annotations

import argparse

from hybrid_transfer.layout import DType, KVLayout, ModelSpec, load_config_file, load_preset, preset_names

KV_DTYPES = {"bf16": DType.BF16, "fp16": DType.FP16, "fp8": DType.FP8}


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """--preset NAME or --config PATH, exactly one."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", metavar="NAME", help=f"shipped preset: {', '.join(preset_names())}")
    source.add_argument("--config", metavar="PATH", help="a model's own config.json (flat or with text_config)")


def load_model(args: argparse.Namespace) -> ModelSpec:
    return load_preset(args.preset) if args.preset is not None else load_config_file(args.config)


def parse_kv_dtype(name: str | None) -> DType | None:
    """The --kv-dtype choice; None keeps the model dtype."""
    return KV_DTYPES[name] if name else None


def add_kv_layout(parser: argparse.ArgumentParser) -> None:
    """--kv-layout interleaved|split (both sides of a transfer share it)."""
    parser.add_argument("--kv-layout", choices=[m.value for m in KVLayout], default=KVLayout.INTERLEAVED.value,
                        help="attention page layout: interleaved [heads][tokens][K|V] (vLLM 0.33) or split "
                             "[K | V] halves (older vLLM)")


def parse_kv_layout(name: str) -> KVLayout:
    return KVLayout(name)
