"""CUDA IPC of a GPU cache, and the mapped path's copy on a GPU: one gather kernel per step.

Handles: each shared tensor's storage is exported with torch's CUDA IPC (the cudaIpcMemHandle of the
allocation that holds it, its offset, and torch's reference-count segment), encoded as one msgpack array
(``export_handles``); a consumer on the same host opens it once per link (``IpcMapping``) and gets the
address of the producer's bytes in its own context. Only same-host CUDA IPC is built; an NVLink domain
across hosts needs fabric handles of VMM allocations (docs/tuning.md#mapped-reads-across-hosts).

The copy, chosen by the copy-path figures measured on one H200 (docs/benchmarks.md#issue-28):
cudaMemcpyBatchAsync costs about 5 us of CPU per range (no better than UCX's cuda_ipc), a gather kernel
over a table of chunks about 0.4 us per range when 16 requests go in one launch, at 0.91-0.99 of a
contiguous copy's bandwidth. So ``RangeCopier`` splits every range into chunks of at most
``CHUNK_BYTES`` (numpy), writes the (src, dst, bytes) table into pinned memory, launches one Triton kernel
(one program per chunk) on its own stream and records an event: the worker thread's work per step is
that, nothing per range in Python. The kernel reads the table where it lies: with unified addressing a
pinned host allocation is addressable from the GPU at its host address, so the table's upload (one more
torch call, about 18 us on the H200 host) is not needed. Where that does not hold (the copier's probe at
start fails), the table is copied up first, as before. The kernel uses SMs of the decode GPU while it
runs (the copy engines are not used).
"""

from __future__ import annotations

import collections
import functools
import logging
import time

import msgspec
import numpy as np

from hybrid_transfer.engine.mapped.host_copy import element_bytes
from hybrid_transfer.errors import MappingError, UnsupportedError

log = logging.getLogger(__name__)

# Bytes per kernel program. Measured on one H200 (benchmarks/mapped_copy.py --chunk-kib, P1->D1 frag 1, 16 per
# step, docs/benchmarks.md#issue-28-second): 256 KiB gave 0.87 of a contiguous copy and 0.53 ms of chunk table,
# 1 MiB 0.95 and 0.22 ms (P2->D8: 0.84 against 0.76), 4 MiB no better than 1 MiB.
CHUNK_BYTES = 1 << 20
BLOCK = 1024  # elements per program iteration
_SLOTS = 8  # tables in flight per copier before the oldest is waited for


class IpcHandle(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """torch's CUDA IPC description of one storage, plus where the tensor starts inside it."""

    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_handle: bytes
    ref_offset: int
    event_handle: bytes
    event_sync: bool
    tensor_offset: int


_decoder = msgspec.msgpack.Decoder(IpcHandle)


def export_handles(tensors) -> list[bytes]:
    """One encoded IpcHandle per CUDA tensor (contiguous uint8, the cache's shared tensors)."""
    out = []
    for t in tensors:
        storage = t.untyped_storage()
        device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = storage._share_cuda_()
        out.append(msgspec.msgpack.encode(IpcHandle(int(device), bytes(handle), int(size), int(offset),
                                                    bytes(ref_handle), int(ref_offset), bytes(event_handle or b""),
                                                    bool(event_sync), int(t.data_ptr() - storage.data_ptr()))))
    return out


class IpcMapping:
    """One producer tensor opened in this process; ``addr`` is its first byte here."""

    def __init__(self, encoded: bytes, length: int, device):
        import torch

        try:
            h = _decoder.decode(encoded)
        except msgspec.DecodeError as exc:
            raise MappingError(f"undecodable CUDA IPC handle: {exc}") from exc
        if h.tensor_offset < 0 or h.tensor_offset + length > h.storage_bytes:
            raise MappingError(f"the CUDA IPC handle covers {h.storage_bytes} bytes, the region needs "
                              f"{h.tensor_offset + length}")
        try:
            with torch.cuda.device(device):
                self._storage = torch.UntypedStorage._new_shared_cuda(
                    h.device, h.handle, h.storage_bytes, h.storage_offset, h.ref_handle, h.ref_offset,
                    h.event_handle, h.event_sync)
        except (RuntimeError, TypeError) as exc:
            raise MappingError(f"cannot open the CUDA IPC handle: {exc}") from exc
        self.addr = int(self._storage.data_ptr()) + h.tensor_offset
        self.length = length

    def close(self) -> None:
        """Drop the mapping (idempotent); the caller has waited for every copy from it."""
        self._storage = None


@functools.cache  # one JIT function a process: its compiled variants serve every copier (a consumer per link)
def _kernel():
    import triton
    import triton.language as tl

    # n_chunks changes with every step: not specialized, or each new value class would compile again.
    @triton.jit(do_not_specialize=["n_chunks"])
    def copy_chunks(table, n_chunks, BLOCK: tl.constexpr, WIDTH: tl.constexpr):  # noqa: N803
        pid = tl.program_id(0)
        src = tl.load(table + pid)
        dst = tl.load(table + n_chunks + pid)
        count = tl.load(table + 2 * n_chunks + pid) // WIDTH
        if WIDTH == 8:
            s = src.to(tl.pointer_type(tl.int64))
            d = dst.to(tl.pointer_type(tl.int64))
        elif WIDTH == 4:
            s = src.to(tl.pointer_type(tl.int32))
            d = dst.to(tl.pointer_type(tl.int32))
        elif WIDTH == 2:
            s = src.to(tl.pointer_type(tl.int16))
            d = dst.to(tl.pointer_type(tl.int16))
        else:
            s = src.to(tl.pointer_type(tl.int8))
            d = dst.to(tl.pointer_type(tl.int8))
        for start in range(0, count, BLOCK):
            o = start + tl.arange(0, BLOCK)
            m = o < count
            tl.store(d + o, tl.load(s + o, mask=m), mask=m)

    return copy_chunks


def chunk_table(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, chunk: int = CHUNK_BYTES) -> np.ndarray:
    """The (src, dst, bytes) rows of every chunk of at most ``chunk`` bytes, as a 3 x N int64 array."""
    nchunks = (lengths + chunk - 1) // chunk
    if lengths.shape[0] and nchunks.max() == 1:  # every range one chunk: the table is the ranges themselves
        return np.stack((src, dst, lengths)).astype(np.int64, copy=False)
    ends = np.cumsum(nchunks)
    total = int(ends[-1]) if ends.shape[0] else 0
    # Each chunk's offset in its range: its index less its range's first chunk index, times the chunk size.
    off = (np.arange(total, dtype=np.int64) - np.repeat(ends - nchunks, nchunks)) * chunk
    out = np.empty((3, total), np.int64)
    np.add(np.repeat(src, nchunks), off, out=out[0])
    np.add(np.repeat(dst, nchunks), off, out=out[1])
    np.minimum(chunk, np.repeat(lengths, nchunks) - off, out=out[2])
    return out


class RangeCopier:
    """One consumer's gather kernel over mapped GPU memory, on its own stream; ``copy`` returns an event."""

    def __init__(self, device, chunk_bytes: int = CHUNK_BYTES, table_in_place: bool | None = None):
        """``table_in_place``: the kernel reads the chunk table from pinned host memory (True) or from a device
        copy of it (False); None probes once which works here (``_probe_in_place``)."""
        import torch

        try:
            self._kernel = _kernel()
        except ImportError as exc:
            raise UnsupportedError(f"the mapped GPU path needs Triton: {exc}") from exc
        self._torch = torch
        self.device = torch.device(device)
        self._index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        self._stream = torch.cuda.Stream(device=self.device)
        # Marks what the caller's stream had queued at each copy; one event serves every copy, since a wait
        # takes the record made just before it.
        self._caller_done = torch.cuda.Event()
        self.chunk_bytes = int(chunk_bytes)  # bytes per kernel program (benchmarks/mapped_copy.py --chunk-kib)
        # (pinned table, its numpy view, device table, event) in use, oldest first
        self._slots: collections.deque = collections.deque()
        self.launches = 0
        # Worker-thread seconds of the last copy: (chunk table, upload, kernel launch and event), for the bench.
        self.last_split = (0.0, 0.0, 0.0)
        self.table_in_place = self._probe_in_place() if table_in_place is None else bool(table_in_place)

    def copy(self, dst: np.ndarray, src: np.ndarray, lengths: np.ndarray):
        """Queue every range on the copier's stream in one launch; the event recorded after it."""
        torch = self._torch
        t0 = time.perf_counter()
        keep = lengths > 0
        if not keep.all():
            dst, src, lengths = dst[keep], src[keep], lengths[keep]
        table = chunk_table(dst, src, lengths, self.chunk_bytes)
        n = int(table.shape[1])
        width = element_bytes(dst, src, lengths) if n else 1
        t1 = t2 = time.perf_counter()
        event = torch.cuda.Event()
        # After what the caller's stream queued (an engine step writing these blocks, say), never before it.
        caller = torch.cuda.current_stream(self._index)
        self._caller_done.record(caller)
        self._stream.wait_event(self._caller_done)
        # The kernel goes on the copier's stream, which Triton takes as the current one. Setting it directly
        # costs less than torch's stream context, which is only needed when another device is current.
        if torch.cuda.current_device() == self._index:
            torch.cuda.set_stream(self._stream)
            try:
                t2 = self._queue(table, n, width, event)
            finally:
                torch.cuda.set_stream(caller)
        else:
            with torch.cuda.stream(self._stream):
                t2 = self._queue(table, n, width, event)
        self.last_split = (t1 - t0, t2 - t1, time.perf_counter() - t2)
        if n:
            self._slots[-1] = (*self._slots[-1][:3], event)
        return event

    def _queue(self, table: np.ndarray, n: int, width: int, event) -> float:
        """Upload the table, launch the kernel and record ``event``, on the current stream (the copier's);
        returns when the upload was queued (perf_counter)."""
        t2 = time.perf_counter()
        if n:
            pinned, pinned_np, table_dev = self._slot(n)
            pinned_np[:3 * n] = table.reshape(-1)  # [src..., dst..., bytes...], what the kernel reads
            if table_dev is not None:
                table_dev[:3 * n].copy_(pinned[:3 * n], non_blocking=True)
            t2 = time.perf_counter()
            self._kernel[(n,)](pinned if table_dev is None else table_dev, n, BLOCK=BLOCK, WIDTH=width)
            self.launches += 1
        event.record(self._stream)
        return t2

    def _slot(self, n: int):
        """A pinned table, its numpy view and its device twin of at least ``n`` columns, not in use by a queued copy.

        The oldest slot is reused once its copy has finished (or, with ``_SLOTS`` in use, after waiting for
        it); a new one is allocated only while every slot is still busy: pinned allocations cost about half
        a millisecond each, which the worker thread must not pay per step (measured on one H200).
        """
        torch = self._torch
        slot = None
        if self._slots:
            old_pinned, old_np, old_dev, event = self._slots[0]
            done = event is None or event.query()
            if done or len(self._slots) >= _SLOTS:
                self._slots.popleft()
                if not done:
                    event.synchronize()  # never reuse a table a queued copy may still read
                if old_pinned.shape[0] >= 3 * n:
                    slot = (old_pinned, old_np, old_dev)
        if slot is None:
            cap = max(n, 1 << 15)
            pinned = torch.empty(3 * cap, dtype=torch.int64, pin_memory=True)
            # The numpy view is made once per table, not per copy; a table read in place has no device twin.
            slot = (pinned, pinned.numpy(),
                    None if self.table_in_place else torch.empty(3 * cap, dtype=torch.int64, device=self.device))
        self._slots.append((*slot, None))
        return slot

    def synchronize(self) -> None:
        self._stream.synchronize()

    def _probe_in_place(self) -> bool:
        """Whether the kernel can read its table from pinned host memory here: a small copy through a pinned
        table with each element width, its bytes compared. Triton checks every pointer argument before it
        launches, so a table the GPU cannot address is refused there (no kernel runs); the upload is used then,
        and after any mismatch. Each width is compiled (or loaded from Triton's cache) here, at the link's
        start: a width first met inside a step would cost that step tens of milliseconds."""
        torch = self._torch
        ok = True
        try:
            with torch.cuda.device(self.device):
                src = torch.arange(1 << 14, dtype=torch.int32, device=self.device)
                size = src.numel() * 4
                lengths = np.array([size // 2, size // 2], np.int64)
                offsets = np.array([0, size // 2], np.int64)
                half = src.numel() // 2
                for width in (8, 4, 2, 1):
                    dst = torch.zeros_like(src)
                    table = chunk_table(dst.data_ptr() + offsets[::-1], src.data_ptr() + offsets, lengths)
                    pinned = torch.empty(table.size, dtype=torch.int64, pin_memory=True)
                    pinned.numpy()[:] = table.reshape(-1)
                    # src and dst were filled on the current stream, the kernel runs on the copier's: wait for them.
                    torch.cuda.synchronize(self.device)
                    with torch.cuda.stream(self._stream):
                        self._kernel[(table.shape[1],)](pinned, table.shape[1], BLOCK=BLOCK, WIDTH=width)
                    self._stream.synchronize()
                    # The two halves were swapped.
                    ok = ok and bool(torch.equal(dst[:half], src[half:]) and torch.equal(dst[half:], src[:half]))
        except (RuntimeError, ValueError, TypeError) as exc:
            log.info("the copier's kernel cannot read its table from pinned host memory (%s): uploading it", exc)
            return False
        if not ok:
            log.warning("a copy through a pinned table moved wrong bytes: the copier uploads its tables")
        return ok
