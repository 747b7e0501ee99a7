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

On CUDA the row index never passes through the host. Row k of the staging belongs to piece
p(k) and is row ``within[k]`` of it; both depend only on the pieces' row counts (the plan's shape,
the same for every request of one shape), so they are built on the device once and cached per
shape with the arena's row view (``IndexCache``). Per request only ``first_row`` (one int64 per
piece) is copied up, from pinned memory, without waiting for the stream; then two kernels queued
back to back, ``first_row[p(k)] + within[k]`` (index_select, add in place), and the copy kernel.
The host's part per request is numpy over the pieces (range check, gcd) and a dict lookup.

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
_PINNED_SLOTS = 8  # per-request first-row uploads in flight per copier, to start with
_PINNED_MAX = 256  # ... at most (each a few KB): past it a new upload waits for the oldest


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

    __slots__ = ("_start", "_mid", "_end", "_elapsed_s", "_index_s", "_keep")

    def __init__(self, elapsed_s: float | None = None, start=None, end=None, keep: tuple = (), mid=None):
        self._elapsed_s = elapsed_s
        self._index_s = 0.0
        self._start, self._mid, self._end, self._keep = start, mid, end, keep

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

    @property
    def index_s(self) -> float:
        """CUDA: the part of ``elapsed_s`` spent uploading and building the row index (0.0 on CPU, until done)."""
        return self._index_s if self.is_done else 0.0

    def _settle(self) -> None:
        self._elapsed_s = self._start.elapsed_time(self._end) / 1e3
        if self._mid is not None:
            self._index_s = self._start.elapsed_time(self._mid) / 1e3
        self._keep = ()


class IndexCache:
    """Per plan shape (row width, row counts of the pieces): the device's row -> piece map and row-in-piece ramp.

    LRU over ``capacity`` shapes; also keeps the arena's row views per row width.
    """

    def __init__(self, device: torch.device, capacity: int = INDEX_CACHE_SHAPES):
        self.device = device
        self.capacity = capacity
        self._maps: collections.OrderedDict[tuple, tuple[torch.Tensor, torch.Tensor]] = collections.OrderedDict()
        self.views: dict[int, tuple] = {}  # row width -> (element width, dtype, arena rows): Copier's
        # A miss uploads from pageable host memory, which waits for the stream it is issued on: built on a stream
        # of its own (idle), so a copier stream backlogged with earlier scatters never blocks the caller.
        self._build_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.hits = 0
        self.misses = 0

    def shape(self, g: int, rows_per: np.ndarray, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(piece of each staging row, its row within that piece), ``num_rows`` each; built on a miss only.

        Index dtypes are int32 where the counts allow (half the bytes the index kernel reads).
        """
        key = (g, rows_per.tobytes())
        found = self._maps.get(key)
        if found is not None:
            self.hits += 1
            self._maps.move_to_end(key)
            return found
        self.misses += 1
        if self._build_stream is None:
            found = self._build(rows_per, num_rows)
        else:
            user = torch.cuda.current_stream(self.device)  # the copier's: it waits for the maps, not the host
            with torch.cuda.stream(self._build_stream):
                found = self._build(rows_per, num_rows)
            user.wait_stream(self._build_stream)
            for t in found:  # used on the copier's stream: not reused before its queued work is done, once evicted
                t.record_stream(user)
        self._maps[key] = found
        if len(self._maps) > self.capacity:
            self._maps.popitem(last=False)
        return found

    def _build(self, rows_per: np.ndarray, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        small = num_rows < 2**31
        counts = torch.as_tensor(rows_per, device=self.device)
        pieces = torch.arange(rows_per.shape[0], dtype=torch.int32 if small else torch.int64, device=self.device)
        piece_of_row = torch.repeat_interleave(pieces, counts, output_size=num_rows)
        before = torch.as_tensor(np.cumsum(rows_per) - rows_per, device=self.device)
        within = torch.arange(num_rows, dtype=torch.int64, device=self.device)
        within -= before.index_select(0, piece_of_row)
        return piece_of_row, within.to(torch.int32) if small else within

    def __len__(self) -> int:
        return len(self._maps)


class _PinnedRing:
    """Pinned host buffers for small uploads that must not wait for the stream (pageable copies would).

    A slot is reused once its last upload ran; when every slot's upload is still queued (the copier's stream
    is that far behind) another slot is added rather than waiting, up to ``_PINNED_MAX`` (then the oldest is
    waited for: bounded by that upload's queue). The decode thread never blocks on a backlog of scatters.
    """

    def __init__(self, slots: int = _PINNED_SLOTS):
        self._slots: list[list] = [[torch.empty(0, dtype=torch.int64), None, 0] for _ in range(slots)]  # buf, event, n
        self._next = 0

    def _free_slot(self) -> list:
        for _ in range(len(self._slots)):
            slot = self._slots[self._next]
            self._next = (self._next + 1) % len(self._slots)
            if slot[1] is None or slot[1].query():
                return slot
        if len(self._slots) < _PINNED_MAX:
            slot = [torch.empty(0, dtype=torch.int64), None, 0]
            self._slots.insert(self._next, slot)
            self._next = (self._next + 1) % len(self._slots)
            return slot
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        slot[1].synchronize()
        return slot

    def stage(self, values: np.ndarray) -> list:
        """Copy ``values`` (int64) into a free pinned slot (host work only); pass the slot to ``upload``."""
        slot = self._free_slot()
        slot[1] = None
        n = values.shape[0]
        if slot[0].shape[0] < n:
            slot[0] = torch.empty(max(n, 2 * slot[0].shape[0]), dtype=torch.int64, pin_memory=True)
        slot[0][:n].numpy()[:] = values
        slot[2] = n
        return slot

    def __len__(self) -> int:
        return len(self._slots)

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
        self.last_rows = (0, 0)  # (row bytes, rows) of the last gather or scatter: benchmarks report them

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
        num_rows = total // g
        self.last_rows = (g, num_rows)
        if self._stream is None:
            t0 = time.perf_counter()
            # Row k of staging <-> arena row first_row[p] + (k - rows before piece p), for the piece p holding k.
            self._copy_host(first_row - (np.cumsum(rows_per) - rows_per), rows_per, num_rows, g, staging, gather)
            return CopyTicket(time.perf_counter() - t0)
        start, mid, end = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        if gather:  # cheap insurance: after any writes to the cache still queued on the caller's stream
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            keep = self._copy_device(first_row, rows_per, num_rows, g, staging, gather, start, mid)
            end.record()
        return CopyTicket(None, start, end, keep, mid)

    def _rows(self, g: int, staging: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Arena and staging as rows of g bytes, in the widest element type dividing g (and the origin)."""
        views = self.index_cache.views if self.index_cache is not None else {}
        found = views.get(g)
        if found is None:
            dtypes = _CUDA_ROW_DTYPES if self.device.type == "cuda" else _ROW_DTYPES
            width, dtype = next((w, d) for w, d in dtypes if g % w == 0 and self.arena.origin % w == 0)
            arena_rows = self.arena.bytes[: (self.arena.nbytes // g) * g].view(dtype).view(-1, g // width)
            found = views[g] = (width, dtype, arena_rows)
        width, dtype, arena_rows = found
        return arena_rows, staging[: num_rows * g].view(dtype).view(num_rows, g // width)

    def row_width(self, g: int) -> int:
        """Bytes per element the index kernels move for rows of ``g`` bytes (benchmarks report it)."""
        dtypes = _CUDA_ROW_DTYPES if self.device.type == "cuda" else _ROW_DTYPES
        return next(w for w, _ in dtypes if g % w == 0 and self.arena.origin % w == 0)

    def _copy_device(self, first_row: np.ndarray, rows_per: np.ndarray, num_rows: int, g: int, staging: torch.Tensor,
                     gather: bool, start, mid) -> tuple:
        """One index_select or index_copy_ kernel over rows; the index is made on the device from the shape's
        cached (piece of row, row within piece) and the per-piece first rows (the only per-request upload).

        ``start`` is recorded once the host's part is done (views, cache lookup, pinned copy): the event
        pair times the device's work, upload and index included; ``mid`` splits off the copy kernel.
        """
        arena_rows, stage_rows = self._rows(g, staging, num_rows)
        piece_of_row, within = self.index_cache.shape(g, rows_per, num_rows)
        slot = self._pinned.stage(first_row)
        start.record()
        first_t = self._pinned.upload(slot, self.device, self._stream)
        index = first_t.index_select(0, piece_of_row)
        index.add_(within)
        mid.record()
        if gather:
            torch.index_select(arena_rows, 0, index, out=stage_rows)
        else:
            arena_rows.index_copy_(0, index, stage_rows)
        return (index, first_t, piece_of_row, within, staging)

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

