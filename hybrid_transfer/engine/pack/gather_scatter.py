"""Pack mode's copies: gather pieces of a cache into dense staging, scatter dense staging into a cache.

One index kernel per list, on CPU or CUDA, no Python loop per piece. The cache's shared tensors are
separate allocations, so a list that touches all of them would need a kernel per tensor; instead an
``Arena`` aliases one uint8 tensor over the whole address span of the cache's tensors (zero-copy, via
the array interface), and every piece becomes rows of that one tensor. Rows are ``g`` bytes, g the
largest common divisor of every piece's start (relative to the arena), length and the staging
pointer, viewed as the widest element type dividing g (int64, on CUDA 16-byte elements, whenever g
allows: the element type decides the speed, docs/benchmarks.md); the row index (one int64 per row)
is built from the piece arrays, then

  gather:  index_select(arena_rows, 0, rows, out=staging_rows)   (staging is dense, in piece order)
  scatter: arena_rows.index_copy_(0, rows, staging_rows)          (CPU: the same as a numpy row assignment)

On CUDA the row index never passes through the host: row k of piece p is ``shift[p] + k``, and the
row -> piece map depends only on the pieces' row counts (the plan's shape, the same for every
request of one shape), so it is uploaded once and cached per shape (``IndexCache``). Per request
only ``shift`` (one int64 per piece) is copied up, from pinned memory, without waiting for the
stream; two small kernels make the index and one kernel copies.

Bytes between the tensors are never touched: every piece is first checked to lie inside one
tensor (RangeError otherwise). On CUDA both run on the copier's own stream (a gather first waits
for work queued on the caller's current stream) and are timed with events; ``CopyTicket.is_done``
tells the caller when the bytes are in place (notify or answer only after that). On CPU they run
inside the call.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence

import numpy as np
import torch

from hybrid_transfer.errors import PlanError, RangeError

_ROW_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))
# CUDA only: rows of 16-byte elements halve the elements an index kernel moves (rows are often only 256 B:
# the gcd of a 397B rank's pieces). Index kernels load and store elements without arithmetic, so every bit
# pattern (NaN payloads included) survives; tests/engine/test_gather_scatter.py checks it bitwise on CUDA.
_CUDA_ROW_DTYPES = ((16, torch.complex128),) + _ROW_DTYPES
INDEX_CACHE_SHAPES = 16  # row -> piece maps kept per copier (a few MB each for a 397B request)
_PINNED_SLOTS = 8  # per-request shift uploads in flight per copier


class _HostIface:
    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


class _CudaIface:
    def __init__(self, addr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False),
                                         "version": 3, "strides": None}


def alias_bytes(addr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over [addr, addr + nbytes) of ``device`` memory that someone else owns."""
    if device.type == "cuda":
        return torch.as_tensor(_CudaIface(addr, nbytes), device=device)
    return torch.from_numpy(np.asarray(_HostIface(addr, nbytes)))


class Arena:
    """One uint8 alias spanning a set of same-device tensors (a cache's shared tensors).

    Keeps the tensors alive; only bytes inside them are ever addressed through it.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]):
        if not tensors:
            raise PlanError("an arena needs at least one tensor")
        devices = {t.device for t in tensors}
        if len(devices) != 1:
            raise PlanError(f"arena tensors sit on several devices: {sorted(map(str, devices))}")
        self.device = devices.pop()
        self._tensors = list(tensors)
        spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
        self.origin = spans[0][0]
        self.nbytes = max(end for _, end in spans) - self.origin
        self._starts = np.array([s for s, _ in spans], dtype=np.int64)
        self._ends = np.array([e for _, e in spans], dtype=np.int64)
        self.bytes = alias_bytes(self.origin, self.nbytes, self.device)

    def largest(self) -> tuple[int, int]:
        """(address, bytes) of the largest tensor."""
        i = int(np.argmax(self._ends - self._starts))
        return int(self._starts[i]), int(self._ends[i] - self._starts[i])

    def check(self, addr: np.ndarray, length: np.ndarray) -> None:
        """Raise RangeError unless every [addr, addr + length) lies inside one of the tensors."""
        if addr.shape[0] == 0:
            return
        i = np.searchsorted(self._starts, addr, side="right") - 1
        ok = (i >= 0) & (length >= 0) & (addr + length <= self._ends[np.maximum(i, 0)])
        if not ok.all():
            k = int(np.flatnonzero(~ok)[0])
            raise RangeError(side="arena", addr=int(addr[k]), length=int(length[k]))


class CopyTicket:
    """One launched gather or scatter: done on CPU at once; on CUDA when its end event completes."""

    __slots__ = ("_start", "_end", "_elapsed_s", "_keep")

    def __init__(self, elapsed_s: float | None = None, start=None, end=None, keep: tuple = ()):
        self._elapsed_s = elapsed_s
        self._start, self._end, self._keep = start, end, keep

    @property
    def is_done(self) -> bool:
        if self._end is None or self._elapsed_s is not None:
            return True
        if not self._end.query():
            return False
        self._settle()
        return True

    def wait(self) -> None:
        """Block until the copy has finished (bounded by the kernel's own run time)."""
        if self._end is not None and self._elapsed_s is None:
            self._end.synchronize()
            self._settle()

    @property
    def elapsed_s(self) -> float:
        """Copy time (index build included); 0.0 until done."""
        return self._elapsed_s if self.is_done and self._elapsed_s is not None else 0.0

    def _settle(self) -> None:
        self._elapsed_s = self._start.elapsed_time(self._end) / 1e3
        self._keep = ()


class IndexCache:
    """Per plan shape (row counts of the pieces), the device's row -> piece map; LRU, ``capacity`` shapes."""

    def __init__(self, device: torch.device, capacity: int = INDEX_CACHE_SHAPES):
        self.device = device
        self.capacity = capacity
        self._maps: collections.OrderedDict[bytes, torch.Tensor] = collections.OrderedDict()
        self._arange = torch.empty(0, dtype=torch.int64, device=device)
        self.hits = 0
        self.misses = 0

    def piece_of_row(self, rows_per: np.ndarray, num_rows: int) -> torch.Tensor:
        """int64 tensor of ``num_rows``: the piece each staging row belongs to (built on a miss only)."""
        key = rows_per.tobytes()
        found = self._maps.get(key)
        if found is not None:
            self.hits += 1
            self._maps.move_to_end(key)
            return found
        self.misses += 1
        counts = torch.as_tensor(rows_per, device=self.device)
        pieces = torch.arange(rows_per.shape[0], dtype=torch.int64, device=self.device)
        found = torch.repeat_interleave(pieces, counts, output_size=num_rows)
        self._maps[key] = found
        if len(self._maps) > self.capacity:
            self._maps.popitem(last=False)
        return found

    def arange(self, n: int) -> torch.Tensor:
        """0 .. n-1 on the device (one tensor, grown when needed)."""
        if self._arange.shape[0] < n:
            self._arange = torch.arange(max(n, 2 * self._arange.shape[0]), dtype=torch.int64, device=self.device)
        return self._arange[:n]

    def __len__(self) -> int:
        return len(self._maps)


class _PinnedRing:
    """Pinned host buffers for small uploads that must not wait for the stream (pageable copies would)."""

    def __init__(self, slots: int = _PINNED_SLOTS):
        self._slots: list[list] = [[torch.empty(0, dtype=torch.int64), None, 0] for _ in range(slots)]  # buf, event, n
        self._next = 0

    def stage(self, values: np.ndarray) -> list:
        """Copy ``values`` (int64) into the next free pinned slot (host work only); pass the slot to ``upload``."""
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        if slot[1] is not None:
            slot[1].synchronize()  # the slot's last upload; long finished unless uploads outrun the stream
            slot[1] = None
        n = values.shape[0]
        if slot[0].shape[0] < n:
            slot[0] = torch.empty(max(n, 2 * slot[0].shape[0]), dtype=torch.int64, pin_memory=True)
        slot[0][:n].numpy()[:] = values
        slot[2] = n
        return slot

    def upload(self, slot: list, device: torch.device, stream) -> torch.Tensor:
        """The staged values on the device, copied on ``stream`` (the current one) without waiting for it."""
        out = slot[0][: slot[2]].to(device, non_blocking=True)
        slot[1] = torch.cuda.Event()
        slot[1].record(stream)
        return out


class Copier:
    """Gathers and scatters between one Arena and staging tensors of the same device."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.device = arena.device
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.index_cache = IndexCache(self.device) if self._stream is not None else None
        self._pinned = _PinnedRing() if self._stream is not None else None

    def gather(self, src_addr: np.ndarray, length: np.ndarray, staging: torch.Tensor) -> CopyTicket:
        """staging[offset_i : offset_i + length_i] = bytes at src_addr_i, offsets the prefix sums of length."""
        return self._run(src_addr, length, staging, gather=True)

    def scatter(self, staging: torch.Tensor, dst_addr: np.ndarray, length: np.ndarray) -> CopyTicket:
        """Bytes at dst_addr_i = staging[offset_i : offset_i + length_i], offsets the prefix sums of length."""
        return self._run(dst_addr, length, staging, gather=False)

    def _run(self, addr: np.ndarray, length: np.ndarray, staging: torch.Tensor, *, gather: bool) -> CopyTicket:
        addr = np.asarray(addr, dtype=np.int64)
        length = np.asarray(length, dtype=np.int64)
        total = int(length.sum())
        if staging.dtype != torch.uint8 or staging.dim() != 1 or staging.device != self.device:
            raise PlanError(f"staging must be a flat uint8 tensor on {self.device}, got {staging.dtype} "
                            f"{tuple(staging.shape)} on {staging.device}")
        if total > staging.numel():
            raise PlanError(f"{total} B of pieces exceed the {staging.numel()} B staging", nbytes=total)
        self.arena.check(addr, length)
        if total == 0:
            return CopyTicket(0.0)
        rel = addr - self.arena.origin
        g = int(np.gcd.reduce(np.concatenate((rel, length, [staging.data_ptr() - self.arena.origin]))))
        first_row, rows_per = rel // g, length // g
        # Row k of staging <-> arena row first_row[p] + (k - rows before piece p), for the piece p holding k.
        shift = first_row - (np.cumsum(rows_per) - rows_per)
        num_rows = total // g
        if self._stream is None:
            t0 = time.perf_counter()
            self._copy_host(shift, rows_per, num_rows, g, staging, gather)
            return CopyTicket(time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if gather:  # cheap insurance: after any writes to the cache still queued on the caller's stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            keep = self._copy_device(shift, rows_per, num_rows, g, staging, gather, start)
            end.record()
        return CopyTicket(None, start, end, keep)

    def _rows(self, g: int, staging: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Arena and staging as rows of g bytes, in the widest element type dividing g (and the origin)."""
        dtypes = _CUDA_ROW_DTYPES if self.device.type == "cuda" else _ROW_DTYPES
        width, dtype = next((w, d) for w, d in dtypes if g % w == 0 and self.arena.origin % w == 0)
        arena_rows = self.arena.bytes[: (self.arena.nbytes // g) * g].view(dtype).view(-1, g // width)
        return arena_rows, staging[: num_rows * g].view(dtype).view(num_rows, g // width)

    def _copy_device(self, shift: np.ndarray, rows_per: np.ndarray, num_rows: int, g: int, staging: torch.Tensor,
                     gather: bool, start) -> tuple:
        """One index_select or index_copy_ kernel over int rows; the index is made on the device from the
        cached row -> piece map of this shape and the per-piece shifts (the only per-request upload).

        ``start`` is recorded once the host's part is done (views, cache lookup): the event pair times
        the device's work, upload and index included, not the host's launch path.
        """
        arena_rows, stage_rows = self._rows(g, staging, num_rows)
        piece_of_row = self.index_cache.piece_of_row(rows_per, num_rows)
        ramp = self.index_cache.arange(num_rows)
        slot = self._pinned.stage(shift)
        start.record()
        shift_t = self._pinned.upload(slot, self.device, self._stream)
        index = torch.add(ramp, shift_t.index_select(0, piece_of_row))
        if gather:
            torch.index_select(arena_rows, 0, index, out=stage_rows)
        else:
            arena_rows.index_copy_(0, index, stage_rows)
        return (index, shift_t, piece_of_row, staging)

    def _copy_host(self, shift: np.ndarray, rows_per: np.ndarray, num_rows: int, g: int, staging: torch.Tensor,
                   gather: bool) -> None:
        """CPU: the index in numpy; gather with torch index_select, scatter with numpy row assignment.

        Measured here (qwen3.5-397b-a17b TP1, 8192 tokens, 444 MB in rows of 256 B, one thread):
        index build numpy 13 ms / torch 36 ms; gather torch index_select 73-77 ms / numpy take 400+ ms;
        scatter torch index_copy_ 153 ms / numpy row assignment 80 ms.
        """
        index = np.repeat(shift, rows_per)
        index += np.arange(num_rows, dtype=np.int64)
        if gather:
            arena_rows, stage_rows = self._rows(g, staging, num_rows)
            torch.index_select(arena_rows, 0, torch.from_numpy(index), out=stage_rows)
        else:
            row = np.dtype((np.void, g))
            arena = self.arena.bytes[: (self.arena.nbytes // g) * g].numpy().view(row)
            arena[index] = staging[: num_rows * g].numpy().view(row)

