"""The mapped path's copy on a CPU host: every range of a step in one call, no Python loop per range.

Linux: ``process_vm_readv`` on this very process (no ptrace permission is needed to read oneself) takes
the step's ranges as two iovec arrays, built with numpy, and the kernel copies them, source stream into
destination stream, in one system call per IOV_MAX (1,024) ranges or per CALL_BYTES (1 GiB: Linux moves at
most 2 GiB less a page per call and returns a short count past that): one copy, no temporary. Measured on
the 2-core CI host: see docs/benchmarks.md#issue-28. A short count (a page not mapped) raises.

Elsewhere (or when the call is refused), numpy rows: one numpy array aliases the whole address span of the ranges (zero-copy, the array interface; no byte
outside a range is touched). Ranges of one length L become rows of an overlapping window view of that
array (shape (span - L + 1, L), strides (w, w)): row r is the L bytes at offset r, so a fancy-index
assignment ``window[dst_rows] = window[src_rows]`` copies every range of that length in one numpy call.
Elements are the widest of 8, 4, 2, 1 bytes dividing every address and length. Python loops only over
the distinct lengths of a step (a few: the planner's ranges come in a handful of sizes) and over chunks
that bound the temporary (``max_chunk_bytes``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import numpy as np
from numpy.lib.stride_tricks import as_strided

from hybrid_transfer.errors import MappingError

MAX_CHUNK_BYTES = 64 << 20  # the gathered source rows of one numpy call, at most (a temporary)
IOV_MAX = 1024  # iovecs one process_vm_readv takes (Linux's UIO_MAXIOV)
CALL_BYTES = 1 << 30  # bytes one process_vm_readv is asked for, at most (Linux's MAX_RW_COUNT is 2 GiB - 4 KiB)


def _vm_readv():
    """libc's process_vm_readv, or None where there is none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_ssize_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_READV = _vm_readv()


class _Iface:
    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def element_bytes(*columns: np.ndarray) -> int:
    """The widest element (8, 4, 2 or 1 bytes) dividing every value of ``columns``."""
    g = int(np.gcd.reduce(np.concatenate([c.astype(np.int64, copy=False) for c in columns]))) if columns else 1
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


def copy_ranges(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, *, method: str = "auto",
                max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]`` (int64 arrays) in this process; bytes moved.

    ``method``: "readv" (process_vm_readv), "rows" (numpy) or "auto" (readv where libc has it).
    The caller has checked every range against mapped memory (source.py): with rows an address outside it
    faults, with readv it raises MappingError. Destination ranges must not overlap one another or a source.
    """
    if method == "readv" or (method == "auto" and _READV is not None):
        return _copy_readv(dst, src, lengths)
    return _copy_rows(dst, src, lengths, max_chunk_bytes)


def _copy_readv(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray) -> int:
    call_bytes = CALL_BYTES
    if _READV is None:
        raise MappingError("process_vm_readv is not available here", operation="mapped copy")
    dst, src, lengths = _split_long(dst.astype(np.int64, copy=False), src.astype(np.int64, copy=False),
                                    lengths.astype(np.int64, copy=False), call_bytes)
    n = int(lengths.shape[0])
    local = np.empty((n, 2), np.int64)  # struct iovec {void *base; size_t len} on LP64
    remote = np.empty((n, 2), np.int64)
    local[:, 0], local[:, 1] = dst, lengths
    remote[:, 0], remote[:, 1] = src, lengths
    pid, moved = os.getpid(), 0
    for first, last in _calls(lengths, call_bytes):
        k = last - first
        want = int(lengths[first:last].sum())
        if want == 0:
            continue
        got = _READV(pid, local[first:].ctypes.data, k, remote[first:].ctypes.data, k, 0)
        if got != want:
            err = ctypes.get_errno()
            raise MappingError(f"process_vm_readv moved {got} of {want} bytes ({os.strerror(err) if got < 0 else 'short'})",
                               operation="mapped copy")
        moved += got
    return moved


def _split_long(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, call_bytes: int):
    """Ranges longer than ``call_bytes`` cut into pieces of at most that many bytes (numpy, no loop per range)."""
    pieces = np.maximum(1, -(-lengths // call_bytes))
    if int(pieces.max(initial=1)) == 1:
        return dst, src, lengths
    owner = np.repeat(np.arange(lengths.shape[0]), pieces)
    first_piece = np.cumsum(pieces) - pieces
    offset = (np.arange(owner.shape[0]) - first_piece[owner]) * call_bytes
    return dst[owner] + offset, src[owner] + offset, np.minimum(lengths[owner] - offset, call_bytes)


def _calls(lengths: np.ndarray, call_bytes: int) -> list[tuple[int, int]]:
    """[first, last) of each system call: at most IOV_MAX ranges and ``call_bytes`` bytes (ranges are <= that)."""
    bounds, first, n = [], 0, int(lengths.shape[0])
    ends = np.cumsum(lengths)
    while first < n:
        base = int(ends[first - 1]) if first else 0
        last = min(n, first + IOV_MAX, int(np.searchsorted(ends, base + call_bytes, side="right")))
        last = max(last, first + 1)
        bounds.append((first, last))
        first = last
    return bounds


def _copy_rows(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, max_chunk_bytes: int) -> int:
    n = int(lengths.shape[0])
    if n == 0:
        return 0
    lengths = lengths.astype(np.int64, copy=False)
    keep = lengths > 0
    if not keep.all():
        dst, src, lengths = dst[keep], src[keep], lengths[keep]
        if lengths.shape[0] == 0:
            return 0
    w = element_bytes(dst, src, lengths)
    lo = int(min(dst.min(), src.min()))
    hi = int(max((dst + lengths).max(), (src + lengths).max()))
    dtype = np.dtype(f"u{w}")
    base = np.asarray(_Iface(lo, hi - lo)).view(dtype)
    d_el, s_el, l_el = (dst - lo) // w, (src - lo) // w, lengths // w
    order = np.argsort(l_el, kind="stable")
    sizes = l_el[order]
    cuts = np.flatnonzero(np.diff(sizes)) + 1
    for part in np.split(order, cuts):  # one part per distinct length
        size = int(l_el[part[0]])
        window = as_strided(base, shape=(base.shape[0] - size + 1, size), strides=(w, w), writeable=True)
        rows = max(1, max_chunk_bytes // (size * w))
        for first in range(0, part.shape[0], rows):
            sel = part[first:first + rows]
            window[d_el[sel]] = window[s_el[sel]]
    return int(lengths.sum())
