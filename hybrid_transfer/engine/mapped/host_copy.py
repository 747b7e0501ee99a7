"""The mapped path's copy on a CPU host: every range of a step in one call, numpy rows, no loop per range.

One numpy array aliases the whole address span of the ranges (zero-copy, the array interface; no byte
outside a range is touched). Ranges of one length L become rows of an overlapping window view of that
array (shape (span - L + 1, L), strides (w, w)): row r is the L bytes at offset r, so a fancy-index
assignment ``window[dst_rows] = window[src_rows]`` copies every range of that length in one numpy call.
Elements are the widest of 8, 4, 2, 1 bytes dividing every address and length. Python loops only over
the distinct lengths of a step (a few: the planner's ranges come in a handful of sizes) and over chunks
that bound the temporary (``max_chunk_bytes``).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

MAX_CHUNK_BYTES = 64 << 20  # the gathered source rows of one numpy call, at most (a temporary)


class _Iface:
    def __init__(self, addr: int, nbytes: int):
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (addr, False), "version": 3}


def element_bytes(*columns: np.ndarray) -> int:
    """The widest element (8, 4, 2 or 1 bytes) dividing every value of ``columns``."""
    g = int(np.gcd.reduce(np.concatenate([c.astype(np.int64, copy=False) for c in columns]))) if columns else 1
    return next(w for w in (8, 4, 2, 1) if g % w == 0)


def copy_ranges(dst: np.ndarray, src: np.ndarray, lengths: np.ndarray, *,
                max_chunk_bytes: int = MAX_CHUNK_BYTES) -> int:
    """Copy ``lengths[i]`` bytes from address ``src[i]`` to ``dst[i]`` (int64 arrays) in this process; bytes moved.

    The caller has checked every range against mapped memory (source.py): an address outside it faults.
    Destination ranges must not overlap one another or a source range.
    """
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
