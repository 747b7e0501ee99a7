"""Typed errors. Every failure the library raises derives from HybridTransferError.

Each subclass keeps the offending values as attributes so callers (and tests)
can act on them without parsing messages.
"""

from __future__ import annotations

from typing import Any, Sequence


class HybridTransferError(Exception):
    """Base class of every error this library raises on purpose."""


class ConfigError(HybridTransferError, ValueError):
    """A model config, preset or option is missing or invalid."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value


class UnknownPresetError(ConfigError):
    """A preset name that the registry does not ship."""

    def __init__(self, name: str, known: Sequence[str]):
        super().__init__(
            f"unknown preset {name!r}; known presets: {', '.join(sorted(known))}",
            field="preset",
            value=name,
        )
        self.name = name
        self.known = tuple(sorted(known))


class ShardingError(ConfigError):
    """A TP size or rank that cannot shard the model's heads or channels."""


class UnsupportedError(HybridTransferError):
    """A feature the library knowingly refuses (DESIGN 4: not supported yet)."""


class CacheShapeError(HybridTransferError, ValueError):
    """A cache allocation or wrapped tensor does not match the geometry."""

    def __init__(self, message: str, *, expected: Any = None, actual: Any = None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class FingerprintMismatch(HybridTransferError):
    """Two engines disagree on fields that must be equal (handshake tier one)."""

    def __init__(self, differences: Sequence[tuple[str, Any, Any]]):
        self.differences = tuple(differences)
        parts = [f"{name}: ours={ours!r} theirs={theirs!r}" for name, ours, theirs in differences]
        super().__init__("incompatible peer: " + "; ".join(parts))


class PlanError(HybridTransferError, ValueError):
    """A transfer request cannot be planned or fails validation."""

    def __init__(self, message: str, **values: Any):
        super().__init__(message)
        self.values = values
        for key, value in values.items():
            setattr(self, key, value)
