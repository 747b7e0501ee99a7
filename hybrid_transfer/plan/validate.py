"""Validation before anything moves (docs/planner.md#validation): request block ids, then the finished plan's ranges and bytes.

The plan checks do not trust the planner: every range is looked up in the
registered regions, destinations are checked for overlap across all sources,
and the bytes are compared with a figure computed from the local geometry alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hybrid_transfer.errors import (
    BlockCountError,
    BlockIdError,
    ByteCountError,
    DuplicateBlockError,
    GroupCountError,
    OverlapError,
    PlanError,
    RangeError,
)
from hybrid_transfer.layout.geometry import RankGeometry
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.plan.types import PackSourcePlan, ReadPlan, SourcePlan


def expected_bytes(local: RankGeometry, num_tokens: int) -> int:
    """Bytes a consumer rank receives for a request: its KV heads for every token and FA layer, plus its state.

    A replicated KV head (TP > K) is still one full head per rank, so ``kv_bytes_per_token`` is right on both sides.
    """
    return ExpectedBytes(local)(num_tokens)


class ExpectedBytes:
    """``expected_bytes`` of one geometry with its two per-geometry figures computed once (a per-request call
    otherwise walks the model's layer list twice: tens of microseconds on the decode thread)."""

    def __init__(self, local: RankGeometry):
        self.kv_bytes_per_token = local.kv_bytes_per_token * local.num_attention_layers
        self.state_bytes = local.state_bytes_per_request

    def __call__(self, num_tokens: int, first_token: int = 0) -> int:
        """Tokens [first_token, num_tokens) and the state at num_tokens (docs/planner.md#prefix-hits)."""
        return (num_tokens - first_token) * self.kv_bytes_per_token + (self.state_bytes if num_tokens > 0 else 0)


def check_first_token(first_token: int, num_tokens: int, block_size: int) -> int:
    """A local prefix hit's end (docs/planner.md#prefix-hits): within the request and on a block boundary of
    the side that holds the hit, so the hit's blocks are whole and nothing of them is written.

    Raises:
        PlanError: naming ``first_token`` and why.
    """
    reason = None
    if first_token > num_tokens:
        reason = f"is past the request's {num_tokens} tokens"
    elif first_token % block_size:
        reason = f"is not on a local block boundary (block size {block_size})"
    if reason is not None:
        raise PlanError(f"first_token={first_token} {reason}", first_token=first_token, num_tokens=num_tokens)
    return first_token


def plain_int64s(ids: Sequence) -> bool:
    """Every element an exact ``int`` (so no bool, no numpy scalar) inside int64, checked in C (set, min, max):
    the common form of block ids, which then convert to int64 without a check per id."""
    return not ids or (set(map(type, ids)) == _EXACT_INT and min(ids) > -(1 << 63) and max(ids) < (1 << 63))


_EXACT_INT = {int}


def block_id_arrays(side: str, block_ids: Sequence[Sequence[int]], num_groups: int) -> list[np.ndarray]:
    """Per-group int64 arrays; rejects a wrong group count and non-integer ids."""
    if len(block_ids) != num_groups:
        raise GroupCountError(side=side, expected=num_groups, actual=len(block_ids))
    out = []
    for group, ids in enumerate(block_ids):
        if type(ids) is np.ndarray and ids.dtype == np.int64 and ids.ndim == 1:
            out.append(ids)  # already converted (the consumer converts once and plans with the arrays)
            continue
        arr = np.asarray(ids)
        if arr.size == 0:
            arr = np.empty(0, dtype=np.int64)
        elif arr.ndim != 1 or arr.dtype.kind not in "iu":
            raise PlanError(f"{side} group {group}: block ids must be a flat list of integers, got {ids!r}",
                            side=side, group=group, block_ids=ids)
        out.append(arr.astype(np.int64, copy=False))
    return out


def validate_block_ids(side: str, ids: Sequence[np.ndarray], kinds: Sequence[LayerKind], num_tokens: int,
                       block_size: int, num_blocks: int, *, exact: bool, flat: np.ndarray | None = None) -> None:
    """List lengths (docs/planner.md#token-rules), id range, uniqueness within and across groups.

    ``exact``: the attention list must cover exactly ceil(num_tokens / block_size) blocks
    (the producer side); otherwise at least that many (the consumer may hold extra blocks).
    ``flat``: ``ids`` already concatenated (the planner's), left as it is.
    """
    need = -(-num_tokens // block_size)
    for group, (arr, kind) in enumerate(zip(ids, kinds, strict=True)):
        n = arr.shape[0]
        if kind is LayerKind.GDN:
            if n != 1:
                raise BlockCountError(side=side, group=group, expected=1, actual=n)
        elif (n != need) if exact else (n < need):
            raise BlockCountError(side=side, group=group, expected=need, actual=n, at_least=not exact)
    if flat is not None:
        srt = np.sort(flat)
    else:
        srt = np.concatenate(ids) if ids else np.empty(0, dtype=np.int64)
        srt.sort()  # np.concatenate made a copy: sort it in place
    if srt.shape[0] == 0:
        return
    if srt[0] < 0 or srt[-1] >= num_blocks:
        for group, arr in enumerate(ids):
            bad = arr[(arr < 0) | (arr >= num_blocks)]
            if bad.shape[0]:
                raise BlockIdError(side=side, group=group, block_id=int(bad[0]), num_blocks=num_blocks)
    dup = (srt[1:] == srt[:-1]).nonzero()[0]
    if dup.shape[0]:
        block_id = int(srt[dup[0]])
        groups = [g for g, arr in enumerate(ids) for b in arr.tolist() if b == block_id]
        raise DuplicateBlockError(side=side, block_id=block_id, groups=groups)


class RegionTable:
    """Registered regions of one rank (start address, length), for vectorised containment checks."""

    def __init__(self, addrs: Sequence[int], lengths: Sequence[int] | int):
        starts = np.asarray(addrs, dtype=np.int64)
        lens = np.broadcast_to(np.asarray(lengths, dtype=np.int64), starts.shape)
        order = np.argsort(starts)
        # A sentinel region that nothing fits in catches addresses below the first region without a mask.
        lowest = np.iinfo(np.int64).min
        self.starts = np.concatenate(([lowest], starts[order]))
        self.ends = np.concatenate(([lowest], starts[order] + lens[order]))
        # ends[i - 1] at i: indexed by searchsorted(starts, side="right") without subtracting 1.
        self._ends_right = np.concatenate(([lowest], self.ends))

    def contains(self, addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """A bool per range: non-empty and inside one region (``check`` without the error)."""
        if addr.shape[0] == 0:
            return np.ones(0, dtype=bool)
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        # Ends compared, not ``ends[idx] - addr``: that wraps for the sentinel (int64 min minus an address), which
        # let a range below the lowest region pass. ``end > addr``: non-empty, and no wrap past int64 max.
        end = addr + length
        return (end <= self.ends[idx]) & (end > addr)

    def holds(self, addr: np.ndarray, end: np.ndarray) -> bool:
        """``contains(addr, end - addr).all()`` in fewer passes (``end``: each range's end, computed by the caller).

        A plan's rows are tensor-major, a run per tensor: split into as many equal runs as there are regions,
        a run lies in one region when its lowest start's region holds its highest end (one min and one max
        per run: 12 us for 4,905 rows, against 30 for a search per row). Rows in any other order take the
        search per row; either way the answer is exact.
        """
        n, k = addr.shape[0], self.starts.shape[0] - 1
        if n == 0:
            return True
        if not (end > addr).all():
            return False
        if k and n % k == 0:
            lo = addr.reshape(k, n // k).min(axis=1)
            hi = end.reshape(k, n // k).max(axis=1)
            if (hi <= self._ends_right[np.searchsorted(self.starts, lo, side="right")]).all():
                return True
        return bool((end <= self._ends_right[np.searchsorted(self.starts, addr, side="right")]).all())

    def holds_ascending(self, addr: np.ndarray, end: np.ndarray) -> bool:
        """``holds`` for ranges ascending by start that do not overlap (``addr[i + 1] >= end[i]``, every range
        non-empty: the caller checked). One search per region instead of one per range: a region's ranges are
        a run, and the run's last end is its largest.

        Tried first, as in ``holds``: as many equal runs as there are regions, each in the region of its first
        start up to its last end (four numpy calls, where a cold decode thread pays 10-40 us a call)."""
        n, k = addr.shape[0], self.starts.shape[0] - 1
        if n == 0:
            return True
        if k and n % k == 0:
            m = n // k
            if (end[m - 1 :: m] <= self._ends_right[np.searchsorted(self.starts, addr[::m], side="right")]).all():
                return True
        first = np.searchsorted(addr, self.starts[1:], side="left")  # each region's first range
        if not first.shape[0] or first[0]:
            return False  # ranges below the lowest region
        stop = np.empty_like(first)
        stop[:-1] = first[1:]
        stop[-1] = n
        used = first < stop
        return bool((end[stop[used] - 1] <= self.ends[1:][used]).all())

    def check(self, side: str, addr: np.ndarray, length: np.ndarray) -> None:
        """Every [addr, addr+length) lies inside one region and is non-empty (``contains``, with the error).

        Raises:
            RangeError: naming the first offending range.
        """
        ok = self.contains(addr, length)
        if not ok.all():
            i = int(np.flatnonzero(~ok)[0])
            raise RangeError(side=side, addr=int(addr[i]), length=int(length[i]))


def validate_plan(plan: ReadPlan, local_regions: RegionTable, remote_regions: Mapping[int, RegionTable]) -> None:
    """Ranges inside registered regions on both sides, no overlapping destinations, bytes as expected.

    Raises:
        RangeError: a range outside the registered regions.
        OverlapError: two destination ranges overlap.
        ByteCountError: the bytes differ from what the request needs.
    """
    rows = []
    for src in plan.sources:
        if isinstance(src, SourcePlan):
            rows.append((src.source_rank, src.local_addr, src.remote_addr, src.length))
        elif isinstance(src, PackSourcePlan):
            d = src.direct  # the same bytes the scatter writes and the source's gather reads
            rows.append((src.source_rank, d.local_addr, d.remote_addr, d.length))
        else:
            raise PlanError(f"unknown source plan type {type(src).__name__}", source=src)
        if src.source_rank not in remote_regions:
            raise PlanError(f"plan reads from source rank {src.source_rank}, which has no registered regions",
                            source_rank=src.source_rank)
    total = 0
    if rows:
        addr = np.concatenate([r[1] for r in rows]) if len(rows) > 1 else rows[0][1]
        length = np.concatenate([r[3] for r in rows]) if len(rows) > 1 else rows[0][3]
        if not _plan_holds(rows, addr, length, local_regions, remote_regions):
            _raise_bad_rows(rows, addr, length, local_regions, remote_regions)
        total = int(length.sum())
    if not total == plan.expected_bytes:
        raise ByteCountError(local_bytes=total, remote_bytes=total, expected_bytes=plan.expected_bytes)


def _plan_holds(rows: list[tuple], addr: np.ndarray, length: np.ndarray, local_regions: RegionTable,
                remote_regions: Mapping[int, RegionTable]) -> bool:
    """Every row non-empty and inside a region on both sides, no two destinations overlapping: the checks of
    ``_raise_bad_rows`` as one yes or no, in a third of its passes over the rows (a 131,072-token P2 -> D8 plan
    has 4,905 rows; per pass about 2 us on the shared CPU host, and the checks were 40% of the plan's time)."""
    end = addr + length
    if not (end > addr).all():
        return False
    # Rows come ascending by local address (the planner sorts them for the merge) unless several sources
    # interleave; ascending and non-overlapping is one compare, and lets the region check search per region.
    if not (addr[1:] >= end[:-1]).all():
        order = addr.argsort(kind="stable")
        addr, end = addr[order], end[order]
        if not (addr[1:] >= end[:-1]).all():
            return False
    if not local_regions.holds_ascending(addr, end):
        return False
    for rank, _, remote, ln in rows:
        if not remote_regions[rank].holds(remote, remote + ln):
            return False
    return True


def _raise_bad_rows(rows: list[tuple], addr: np.ndarray, length: np.ndarray, local_regions: RegionTable,
                    remote_regions: Mapping[int, RegionTable]) -> None:
    """The first failing check's error, naming its range (``_plan_holds`` only says that one fails).

    Raises:
        RangeError: a range outside the registered regions (local side first).
        OverlapError: two destination ranges overlap.
    """
    local_regions.check("local", addr, length)
    for rank, _, remote, ln in rows:
        remote_regions[rank].check(f"remote rank {rank}", remote, ln)
    order = addr.argsort(kind="stable")
    a, ln = addr[order], length[order]
    bad = (a[1:] < a[:-1] + ln[:-1]).nonzero()[0]
    if bad.shape[0]:
        i = int(bad[0])
        raise OverlapError(first=(int(a[i]), int(ln[i])), second=(int(a[i + 1]), int(ln[i + 1])))
