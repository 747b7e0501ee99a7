"""Apply a ReadPlan to plain memory: the dry-run and test stand-in for NIXL.

A MemorySpace maps absolute address ranges to writable uint8 numpy buffers
(for a CPU HybridCache: ``hybrid_transfer.memory_space(cache)``). Pack
plans go through temporary staging buffers exactly as the engine would:
gather on the source, one "read" of the staging range, scatter on arrival.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping

import numpy as np

from hybrid_transfer.errors import PlanError, RangeError
from hybrid_transfer.plan.types import PackSourcePlan, ReadPlan, SourcePlan


class MemorySpace:
    """Absolute address ranges of one rank, backed by writable byte buffers."""

    def __init__(self, name: str = "memory"):
        self.name = name
        self._starts: list[int] = []
        self._buffers: list[np.ndarray] = []

    def register(self, addr: int, buffer: np.ndarray) -> None:
        """Make ``buffer`` (any C-contiguous writable array; viewed as bytes) answer for [addr, addr+nbytes)."""
        if not buffer.flags.c_contiguous or not buffer.flags.writeable:
            raise PlanError(f"{self.name}: buffer at {addr:#x} must be C-contiguous and writable", addr=addr)
        raw = buffer.reshape(-1).view(np.uint8)
        i = bisect.bisect_left(self._starts, addr)
        prev_end = self._starts[i - 1] + self._buffers[i - 1].shape[0] if i else None
        if (prev_end is not None and prev_end > addr) or (i < len(self._starts) and self._starts[i] < addr + raw.shape[0]):
            raise PlanError(f"{self.name}: buffer at {addr:#x} overlaps a registered one", addr=addr)
        self._starts.insert(i, addr)
        self._buffers.insert(i, raw)

    def view(self, addr: int, length: int) -> np.ndarray:
        """The bytes [addr, addr+length) as a writable view.

        Raises:
            RangeError: the range is not inside one registered buffer.
        """
        i = bisect.bisect_right(self._starts, addr) - 1
        if i < 0 or length < 0:
            raise RangeError(side=self.name, addr=addr, length=length)
        off = addr - self._starts[i]
        buf = self._buffers[i]
        if off + length > buf.shape[0]:
            raise RangeError(side=self.name, addr=addr, length=length)
        return buf[off : off + length]


def execute(plan: ReadPlan, local: MemorySpace, remotes: Mapping[int, MemorySpace]) -> None:
    """Move a plan's bytes: direct rows copy remote -> local; pack plans gather, read staging, scatter."""
    for src in plan.sources:
        if src.source_rank not in remotes:
            raise PlanError(f"no memory for source rank {src.source_rank}", source_rank=src.source_rank)
        remote = remotes[src.source_rank]
        if isinstance(src, SourcePlan):
            for la, ra, n in zip(src.local_addr.tolist(), src.remote_addr.tolist(), src.length.tolist(), strict=True):
                local.view(la, n)[:] = remote.view(ra, n)
        elif isinstance(src, PackSourcePlan):
            execute_pack(src, local, remote)
        else:
            raise PlanError(f"unknown source plan type {type(src).__name__}", source=src)


def execute_pack(src: PackSourcePlan, local: MemorySpace, remote: MemorySpace) -> None:
    total = src.total_bytes
    remote_staging = np.empty(total, dtype=np.uint8)
    rows = list(zip(src.gather_src.tolist(), src.scatter_dst.tolist(), src.staging_offset.tolist(),
                    src.length.tolist(), strict=True))
    for ga, _, off, n in rows:
        remote_staging[off : off + n] = remote.view(ga, n)
    local_staging = remote_staging.copy()  # the one READ of the whole staging range
    for _, sa, off, n in rows:
        local.view(sa, n)[:] = local_staging[off : off + n]
