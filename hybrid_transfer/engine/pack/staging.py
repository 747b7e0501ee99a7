"""A bounded pool of registered staging memory for pack mode, one per rank.

One tensor of ``EngineConfig.staging_bytes``, registered with the rank's NIXL agent once (docs/tuning.md#agents:
whole tensors, never per request), carved into slices first-fit. A request whose bytes do not fit
gets no slice (``try_alloc`` returns None): the caller falls back to direct reads, which need no
staging, rather than wait (see engine/config.py for why). Owned by the rank's owner thread.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from hybrid_transfer.cache import Region
from hybrid_transfer.errors import ConfigError, PlanError

ALIGN_BYTES = 512  # slice starts: every row width and element type of gather_scatter fits


@dataclass(frozen=True, eq=False)
class StagingSlice:
    """``nbytes`` of the pool at ``offset``; ``tensor`` is the flat uint8 view of exactly those bytes."""

    offset: int
    nbytes: int
    tensor: torch.Tensor

    @property
    def addr(self) -> int:
        return self.tensor.data_ptr()


class StagingPool:
    """First-fit allocator over one staging tensor; freed neighbours merge."""

    def __init__(self, capacity_bytes: int, device: torch.device | str = "cpu"):
        if not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ConfigError(f"staging pool of {capacity_bytes!r} bytes must be a positive integer",
                              field="staging_bytes", value=capacity_bytes)
        self.capacity_bytes = capacity_bytes
        self.tensor = torch.empty(capacity_bytes, dtype=torch.uint8, device=device)
        self.device = self.tensor.device
        self._free: list[tuple[int, int]] = [(0, capacity_bytes)]  # (offset, nbytes), sorted, never adjacent
        self._used: dict[int, tuple[int, StagingSlice]] = {}  # offset -> (aligned size, the live slice)

    @property
    def region(self) -> Region:
        """The whole pool, as NIXL registers it."""
        dev = self.device
        return Region(addr=self.tensor.data_ptr(), length=self.capacity_bytes,
                      device_id=(dev.index or 0) if dev.type == "cuda" else 0, is_cuda=dev.type == "cuda")

    @property
    def bytes_in_use(self) -> int:
        return sum(size for size, _ in self._used.values())

    @property
    def num_slices(self) -> int:
        return len(self._used)

    def try_alloc(self, nbytes: int) -> StagingSlice | None:
        """A slice of at least ``nbytes`` (rounded up to ALIGN_BYTES), or None when no free run is that long."""
        if nbytes <= 0:
            raise PlanError(f"a staging slice of {nbytes} bytes", nbytes=nbytes)
        size = -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
        for i, (off, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, free - size)
                piece = StagingSlice(off, nbytes, self.tensor[off : off + nbytes])
                self._used[off] = (size, piece)
                return piece
        return None

    def free(self, piece: StagingSlice) -> None:
        """Return a slice; the caller guarantees no NIXL handle or kernel can still touch it.

        Raises:
            PlanError: the slice is not live in this pool (a double free).
        """
        used = self._used.get(piece.offset)
        if used is None or used[1] is not piece:
            raise PlanError(f"staging slice at offset {piece.offset} is not allocated", offset=piece.offset)
        size = self._used.pop(piece.offset)[0]
        off = piece.offset
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and off + size == self._free[i][0]:
            size += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:
            off, size = self._free[i - 1][0], self._free[i - 1][1] + size
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (off, size))
