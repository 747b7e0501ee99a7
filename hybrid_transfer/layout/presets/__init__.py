"""The shipped model presets: small config.json extracts inside the package."""

from __future__ import annotations

import json
from importlib import resources

from hybrid_transfer.errors import UnknownPresetError
from hybrid_transfer.layout.model import ModelSpec, model_from_config

_PACKAGE = "hybrid_transfer.layout.presets"


def preset_names() -> tuple[str, ...]:
    """Names of every shipped preset, sorted."""
    files = resources.files(_PACKAGE).iterdir()
    return tuple(sorted(f.name.removesuffix(".json") for f in files if f.name.endswith(".json")))


def preset_config(name: str) -> dict:
    """The config.json extract of a shipped preset.

    Raises:
        UnknownPresetError: no preset has that name.
    """
    names = preset_names()
    if name not in names:
        raise UnknownPresetError(name, names)
    return json.loads(resources.files(_PACKAGE).joinpath(f"{name}.json").read_text())


def load_preset(name: str) -> ModelSpec:
    """Load a shipped preset by name, e.g. ``qwen3.5-397b-a17b``.

    Raises:
        UnknownPresetError: no preset has that name.
    """
    return model_from_config(preset_config(name), name=name)
