"""The doctor's vocabulary: a check's verdict, the report, the options. Imports no other doctor module."""

from __future__ import annotations

import enum
import logging
from typing import Any

import msgspec

from hybrid_transfer.errors import ConfigError

log = logging.getLogger(__name__)

DEFAULT_NUM_BYTES = 64 << 20  # one descriptor: big enough to show a transport's rate, 15 ms on DRAM here
MIN_NUM_BYTES = 4096


class Status(enum.Enum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"


class Device(enum.Enum):
    AUTO = "auto"  # cuda when torch sees a GPU, else cpu
    CPU = "cpu"  # DRAM checks only
    CUDA = "cuda"  # DRAM and VRAM checks; a host without a GPU fails them


class CheckResult(msgspec.Struct, frozen=True):
    """One check's verdict. ``fix`` is empty when the status is pass."""

    name: str
    status: Status
    detail: str
    fix: str = ""
    data: dict[str, Any] = msgspec.field(default_factory=dict)


class DoctorReport(msgspec.Struct, frozen=True):
    checks: tuple[CheckResult, ...]

    @property
    def ok(self) -> bool:
        """True when no check failed (warnings allowed)."""
        return all(c.status is not Status.FAIL for c in self.checks)

    def to_builtins(self) -> dict[str, Any]:
        return {"checks": msgspec.to_builtins(list(self.checks)), "ok": self.ok}


class DoctorOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``doctor`` checks. host/port None: the engine's defaults (EngineConfig)."""

    device: Device = Device.AUTO
    host: str | None = None
    port: int | None = None
    num_bytes: int = DEFAULT_NUM_BYTES
    repeats: int = 5  # timed READs per loopback run, after one warm-up READ
    progress_sample_s: float = 0.5
    timeout_s: float = 60.0  # per loopback run

    def validate(self) -> DoctorOptions:
        if self.num_bytes < MIN_NUM_BYTES or self.num_bytes % 8:
            raise ConfigError(f"num_bytes={self.num_bytes} must be a multiple of 8 and at least {MIN_NUM_BYTES}",
                              field="num_bytes", value=self.num_bytes)
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535]", field="port", value=self.port)
        if self.repeats < 1:
            raise ConfigError(f"repeats={self.repeats} must be at least 1", field="repeats", value=self.repeats)
        return self


def not_run(name: str, why: str) -> CheckResult:
    """A check that could not run because an earlier one failed (that one carries the fix)."""
    return CheckResult(name=name, status=Status.WARN, detail=f"not run: {why}", fix="fix the failed check above")


def gpu_info() -> tuple[bool, int]:
    """(torch sees a GPU, number of GPUs); (False, 0) when torch is missing or has no CUDA."""
    try:
        import torch
    except ImportError:
        return False, 0
    try:
        available = bool(torch.cuda.is_available())
        return available, int(torch.cuda.device_count()) if available else 0
    except Exception as exc:  # a broken driver raises here; the doctor reports it as "no GPU"
        log.warning("torch.cuda query failed: %s", exc)
        return False, 0
