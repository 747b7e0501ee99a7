"""Coalescing: merge byte ranges that are contiguous on both sides, without a Python loop per range.

A piece is a row (local_addr, remote_addr, length). Rows are sorted by local
address; a row merges into the previous one when it starts where the previous
ends on both sides (and, optionally, carries the same key). Because
destinations never overlap, every pair contiguous on both sides becomes
adjacent after the sort, so one pass finds all merges.
"""

from __future__ import annotations

import numpy as np


def merge_ranges(
    local_addr: np.ndarray,
    remote_addr: np.ndarray,
    length: np.ndarray,
    key: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Sort by local address and merge rows contiguous on both sides (and equal in ``key`` when given).

    Returns new int64 (local_addr, remote_addr, length) columns, ascending in local address.
    """
    n = local_addr.shape[0]
    if n == 0:
        empty = np.empty(0, dtype=np.int64)
        return empty, empty.copy(), empty.copy()
    # Stable sort: generation order is nearly sorted already, and timsort is linear on sorted runs.
    order = local_addr.argsort(kind="stable")
    loc = local_addr[order]
    rem = remote_addr[order]
    ln = length[order]
    cont = (loc[1:] == loc[:-1] + ln[:-1]) & (rem[1:] == rem[:-1] + ln[:-1])
    if key is not None:
        k = key[order]
        cont &= k[1:] == k[:-1]
    starts = np.concatenate(([True], ~cont)).nonzero()[0]
    if starts.shape[0] == n:
        return loc, rem, ln
    return loc[starts], rem[starts], np.add.reduceat(ln, starts)
