"""Arguments several subcommands share: which model, which KV dtype and layout, counts, and output paths.

Every value is checked before the work starts, so bad input ends with exit 2 and a message that
names it (argparse's own errors, or a ConfigError caught by ``main``), never a traceback.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import DType, KVLayout, ModelSpec, load_preset, model_from_config, preset_names
from hybrid_transfer.layout.model import context_tokens, read_config_file
from hybrid_transfer.layout.presets import preset_config

KV_DTYPES = {"bf16": DType.BF16, "fp16": DType.FP16, "fp8": DType.FP8}
# Token cap for a config that does not state its context (max_position_embeddings): 1 Mi tokens.
DEFAULT_MAX_TOKENS = 1 << 20


def add_model_source(parser: argparse.ArgumentParser) -> None:
    """--preset NAME or --config PATH, exactly one."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--preset", metavar="NAME", help=f"shipped preset: {', '.join(preset_names())}")
    source.add_argument("--config", metavar="PATH", help="a model's own config.json (flat or with text_config)")


def load_model(args: argparse.Namespace) -> ModelSpec:
    return load_model_and_context(args)[0]


def load_model_and_context(args: argparse.Namespace) -> tuple[ModelSpec, int]:
    """The model, and the most tokens a request may have (its context, else DEFAULT_MAX_TOKENS)."""
    if args.preset is not None:
        config, spec = preset_config(args.preset), load_preset(args.preset)
    else:
        path = Path(args.config)
        config = read_config_file(path)
        spec = model_from_config(config, name=path.parent.name or path.stem)
    return spec, context_tokens(config) or DEFAULT_MAX_TOKENS


def check_tokens(tokens: int, max_tokens: int, model: ModelSpec, flag: str = "--tokens") -> None:
    if tokens > max_tokens:
        raise ConfigError(f"{flag} {tokens} exceeds the {max_tokens} tokens that {model.name} allows "
                          "(its max_position_embeddings, or the default cap when the config does not say)",
                          field=flag.lstrip("-"), value=tokens)


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


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive integer")
    return value


def non_negative_int(text: str) -> int:
    """An argparse type: an integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be an integer >= 0")
    return value


def token_count(text: str) -> int:
    """An argparse type: a whole number of tokens >= 0, also written as 1e5 or 32e3."""
    try:
        value = int(text)
    except ValueError:
        try:
            number = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number of tokens") from None
        if not math.isfinite(number) or number != math.floor(number):
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of tokens") from None
        value = int(number)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0 tokens")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def check_output_path(path: Path, flag: str) -> None:
    """Raise ConfigError unless ``path`` can be written; leaves the file system as it was.

    Run before long work, so a typo in an output path does not cost the whole run.
    """
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{flag} {str(path)!r} {why}", field=flag.lstrip("-"), value=str(path))

    if path.is_dir():
        raise bad("is a directory; name a file")
    parent = path.parent
    if not parent.is_dir():
        raise bad(f"cannot be written: {str(parent)!r} is not a directory")
    existed = path.exists()
    try:
        with path.open("ab"):  # append mode: an existing file keeps its bytes
            pass
    except OSError as exc:
        raise bad(f"cannot be written: {exc.strerror or exc}") from exc
    if not existed:
        path.unlink(missing_ok=True)
