"""Apply a ReadPlan to plain memory: the dry-run and test stand-in for NIXL.

A MemorySpace maps absolute address ranges to writable uint8 numpy buffers
(for a CPU HybridCache: ``hybrid_transfer.memory_space(cache)``). Pack
plans go through temporary staging buffers exactly as the engine does:
the source's gather in its canonical order, one "read" of the plan's ranges of
it, the scatter of those ranges on arrival.
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
    """The engine's pack path on plain memory: the source's gather, the one READ of ranges, the scatter."""
    layout, read = src.layout, src.read
    remote_staging = np.empty(layout.total_bytes, dtype=np.uint8)
    for a, n, off in zip(layout.addr.tolist(), layout.length.tolist(), layout.offset.tolist(), strict=True):
        remote_staging[off : off + n] = remote.view(a, n)
    local_staging = np.empty(read.total_bytes, dtype=np.uint8)
    for ro, lo, n in zip(read.remote_offset.tolist(), read.local_offset.tolist(), read.length.tolist(), strict=True):
        local_staging[lo : lo + n] = remote_staging[ro : ro + n]
    for so, da, n in zip(read.scatter_src.tolist(), read.scatter_dst.tolist(), read.scatter_length.tolist(),
                         strict=True):
        local.view(da, n)[:] = local_staging[so : so + n]
