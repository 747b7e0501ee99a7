"""Direct rows of a step's requests in one numpy pass, and the step's checks in a handful more.

A request's plan is small (a few dozen pieces broadcast over the shared tensors), so its cost is numpy
call overhead, about a microsecond a call, not the arithmetic. Here every request's pieces (its shape's
Recipe over its block ids) are laid end to end, sorted once by (request, local offset), merged once and
broadcast over the tensors' base addresses with one gather; each request's SourcePlans are slices of the
batch's columns. The rows, and their order, are those each request gets planned alone: per request, per
source in template order, tensor-major (what ``Planner.plan`` returned before this pass existed).

The checks here only say yes or no for a whole step, and are strict: a step they do not pass is checked
again by the exact per-request functions (plan/batch_checks.py, plan/validate.py), which name the error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from hybrid_transfer.plan.pieces import Recipe
from hybrid_transfer.plan.templates import SOURCE_MASK, SOURCE_SHIFT

_SPREAD_CACHE_SIZE = 256


_min, _max, _sum = np.minimum.reduce, np.maximum.reduce, np.add.reduce  # ndarray.min() & co. add a Python frame


@dataclass(frozen=True)
class Broadcast:
    """What the rows need of a planner, fixed at its construction.

    ``limits``: per side, a row whose offset lies in [0, limit) of its own tensor, end included, is inside a
    registered region (None: the regions do not allow that shortcut, so every step takes the exact check)."""

    bases: np.ndarray  # [2, tensor, 1]: each tensor's local base address, and its first source's
    remote_base: np.ndarray  # [tensor, source]
    pages: np.ndarray  # [[local page bytes], [remote page bytes]]
    num_sources: int
    padded: bool  # some group is not on every tensor: rows carry their tensor count (Recipe.tensors)
    limits: tuple[int, int] | None

    @property
    def num_tensors(self) -> int:
        return self.bases.shape[1]

    @property
    def request_shift(self) -> int:
        """Bit of the request tag in a sort key: above the local offsets and their source tag."""
        return SOURCE_SHIFT + self.num_sources.bit_length()


@dataclass
class Merged:
    """Every request's merged (per tensor) rows, request-major, each request's ascending by tagged local offset.

    ``rows``: [local, remote] offsets, tags removed; ``bounds[r]:bounds[r + 1]``: request r's rows; ``src``: each
    row's source index (None with one source); ``ntens``: on how many tensors each row lies (None when every
    group is on every tensor)."""

    rows: np.ndarray
    length: np.ndarray
    bounds: list[int]
    src: np.ndarray | None
    ntens: np.ndarray | None


def stacked(rec: Recipe, local_len: int, num_tensors: int) -> Recipe:
    """``rec`` with its two sides as [2, piece] arrays indexing one request's local and remote ids laid end to
    end (``local_len`` local ids first), the padded-tensor tag folded into the remote constants, so both
    sides take one gather, one multiply and one add."""
    remote_const = rec.remote_const
    if rec.tensors is not None:  # pieces on different tensor counts never merge (Planner._merge)
        remote_const = remote_const + ((num_tensors - rec.tensors) << SOURCE_SHIFT)
    return Recipe(rec.local_sel, rec.local_const, rec.remote_sel, rec.remote_const, rec.length, rec.key, rec.tail,
                  rec.tensors, np.stack((rec.local_sel, rec.remote_sel + local_len)),
                  np.stack((rec.local_const, remote_const)))


def merge_rows(jobs: Sequence[tuple[Recipe, np.ndarray]], bc: Broadcast) -> Merged:
    """Pieces of every (stacked recipe, local and remote ids laid end to end) job, merged per request.

    A row merges into the previous one when it starts where that one ends on both sides (and, in naive
    mode, has the same key) and belongs to the same request: ``merge_ranges`` per request, at once."""
    if len(jobs) == 1:
        rec, ids = jobs[0]
        offs = ids[rec.sel2] * bc.pages + rec.const2
        length, key = rec.length, rec.key
        firsts = [0, length.shape[0]]
        order = offs[0].argsort(kind="stable")
    else:
        recs = [rec for rec, _ in jobs]
        counts = [rec.length.shape[0] for rec in recs]
        firsts = list(accumulate(counts, initial=0))
        sel = np.concatenate([rec.sel2 for rec in recs], axis=1)
        sel += np.repeat(list(accumulate((ids.shape[0] for _, ids in jobs[:-1]), initial=0)), counts)
        offs = np.concatenate([ids for _, ids in jobs])[sel] * bc.pages
        offs += np.concatenate([rec.const2 for rec in recs], axis=1)
        length = np.concatenate([rec.length for rec in recs])
        key = None if recs[0].key is None else np.concatenate([rec.key for rec in recs])
        req = np.repeat(np.arange(len(jobs), dtype=np.int64), counts)
        order = (offs[0] + (req << bc.request_shift)).argsort(kind="stable")
    n = length.shape[0]
    if n == 0:
        return Merged(np.empty((2, 0), dtype=np.int64), length[:0], [0] * (len(jobs) + 1),
                      None if bc.num_sources == 1 else length[:0], length[:0] if bc.padded else None)
    s = offs.take(order, axis=1)  # a third of ``offs[:, order]``'s time
    ln = length[order]
    cont = s[:, 1:] == s[:, :-1] + ln[:-1]
    cont = cont[0] & cont[1]
    if key is not None:
        k = key[order]
        cont &= k[1:] == k[:-1]
    cuts = [p - 1 for p in firsts[1:-1] if 0 < p < n]  # a request's first piece starts a row
    if cuts:
        cont[cuts] = False
    head = np.empty(n, dtype=bool)
    head[0] = True
    np.logical_not(cont, out=head[1:])
    starts = head.nonzero()[0]
    if starts.shape[0] != n:
        s, ln = s.take(starts, axis=1), np.add.reduceat(ln, starts)
    bounds = [0, s.shape[1]] if len(jobs) == 1 else np.searchsorted(starts, firsts).tolist()
    src = ntens = None
    if bc.num_sources > 1:
        src = s[0] >> SOURCE_SHIFT
        s[0] &= SOURCE_MASK
    if bc.padded:
        ntens = bc.num_tensors - (s[1] >> SOURCE_SHIFT)
        s[1] &= SOURCE_MASK
    return Merged(s, ln, bounds, src, ntens)


def segment_bounds(m: Merged, num_sources: int) -> list[int]:
    """Row bounds of every (request, source) segment, request-major: [r * num_sources + s] to the next."""
    if num_sources == 1:
        return m.bounds
    req = np.repeat(np.arange(len(m.bounds) - 1, dtype=np.int64), np.diff(m.bounds))
    segs = np.arange(len(m.bounds) * num_sources - num_sources + 1, dtype=np.int64)
    return np.searchsorted(req * num_sources + m.src, segs).tolist()


class Spreader:
    """Rows broadcast over the tensors: per segment of m merged rows, T * m rows, tensor-major.

    The gather that lays every segment's [tensor, row] block end to end depends only on the segment sizes,
    so it is cached on them (a step of one shape repeats them)."""

    def __init__(self, bc: Broadcast):
        self.bc = bc
        self._index: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def spread(self, m: Merged, seg: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
        """(local, remote, length) of every output row, and each segment's output bounds."""
        bc, t = self.bc, self.bc.num_tensors
        if m.src is None:  # one source: both sides in one add, [side, tensor, row]
            both = (bc.bases + m.rows[:, None, :]).reshape(2, -1)
            loc, rem = both[0], both[1]
        else:
            loc = (bc.bases[0] + m.rows[0]).ravel()
            rem = (bc.remote_base[:, m.src] + m.rows[1]).ravel()
        if len(seg) == 2 and m.ntens is None:  # one segment: the [tensor, row] block as it is
            return loc, rem, m.length[None, :].repeat(t, axis=0).ravel(), [0, loc.shape[0]]
        idx, col, tensor = self._gather(tuple(np.diff(seg).tolist()), t)
        loc, rem, length = loc[idx], rem[idx], m.length[col]
        if m.ntens is None:
            return loc, rem, length, [t * b for b in seg]
        held = tensor < m.ntens[col]  # a padded group's rows lie on the tensors holding its layers only
        kept = np.zeros(held.shape[0] + 1, dtype=np.int64)
        np.cumsum(held, out=kept[1:])
        return loc[held], rem[held], length[held], kept[[t * b for b in seg]].tolist()

    def _gather(self, sizes: tuple[int, ...], t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        got = self._index.get(sizes)
        if got is None:
            m = np.array(sizes, dtype=np.int64)
            first = np.concatenate(([0], np.cumsum(m)[:-1]))
            owner = np.repeat(np.arange(m.shape[0], dtype=np.int64), t * m)
            pos = np.arange(t * int(m.sum()), dtype=np.int64) - np.repeat(t * first, t * m)
            width = m[owner]
            tensor = pos // width
            col = first[owner] + pos - tensor * width
            got = (tensor * int(m.sum()) + col, col, tensor)
            if len(self._index) >= _SPREAD_CACHE_SIZE:
                self._index.pop(next(iter(self._index)))
            self._index[sizes] = got
        return got


def rows_fine(m: Merged, expected: Sequence[int], bc: Broadcast) -> bool:
    """Whether every request's rows certainly pass ``validate_plan``: non-empty, inside their own tensor's
    region on both sides, no two destinations of a request overlapping, the bytes each request expects.

    Strict, not exact: False sends the step to the exact check. Sound because a row's tensor regions do not
    overlap (``limits`` is set only then), so rows of different tensors never overlap, and rows of one
    tensor are compared after sorting by offset."""
    if bc.limits is None:
        return False
    rows, ln = m.rows, m.length
    if ln.shape[0] == 0:
        return not any(expected)
    if _min(ln) <= 0 or _min(rows, axis=None) < 0:
        return False
    end = rows + ln
    hi_l, hi_r = _max(end, axis=1).tolist()
    if hi_l > bc.limits[0] or hi_r > bc.limits[1]:
        return False
    local, end_l = rows[0], end[0]
    if m.src is not None:  # several sources interleave in local address: sort each request's rows again
        req = np.repeat(np.arange(len(m.bounds) - 1, dtype=np.int64), np.diff(m.bounds))
        order = (local + (req << bc.request_shift)).argsort(kind="stable")
        local, end_l = local[order], end_l[order]
    clash = local[1:] < end_l[:-1]
    cuts = [b - 1 for b in m.bounds[1:-1] if 0 < b < local.shape[0]]
    if cuts:
        clash[cuts] = False  # rows of two requests
    if np.count_nonzero(clash):
        return False
    weight = ln * bc.num_tensors if m.ntens is None else ln * m.ntens
    if len(expected) == 1:
        return int(_sum(weight)) == expected[0]
    total = np.zeros(weight.shape[0] + 1, dtype=np.int64)
    np.cumsum(weight, out=total[1:])
    return np.diff(total[m.bounds]).tolist() == list(expected)


class IdCheck:
    """Whether every request's ids certainly pass both sides' range and uniqueness checks of
    ``validate_block_ids`` (the counts are the caller's): strict, as ``rows_fine``.

    A request's ids come local then remote, laid end to end. Each (request, side) gets its own window of
    ``max(blocks) + 1`` values, so one sort finds a repeat within any of them; the windows' offsets depend
    only on the list sizes and are cached on them."""

    def __init__(self, local_blocks: int, remote_blocks: int):
        self.local_blocks, self.remote_blocks = local_blocks, remote_blocks
        self._width = max(local_blocks, remote_blocks) + 1
        self._windows: dict[tuple[int, ...], np.ndarray] = {}

    def __call__(self, ids: Sequence[np.ndarray], local_lens: Sequence[int]) -> bool:
        if len(ids) == 1:
            flat, sizes = ids[0], (local_lens[0], ids[0].shape[0] - local_lens[0])
        else:
            flat = np.concatenate(ids)
            sizes = tuple(n for a, nl in zip(ids, local_lens, strict=True) for n in (nl, a.shape[0] - nl))
        if flat.shape[0] == 0:
            return True
        if _min(flat) < 0:
            return False
        if _max(flat) >= min(self.local_blocks, self.remote_blocks) and not self._in_range(flat, sizes):
            return False
        keyed = flat + self._window(sizes)
        keyed.sort()
        return not np.count_nonzero(keyed[1:] == keyed[:-1])

    def _in_range(self, flat: np.ndarray, sizes: tuple[int, ...]) -> bool:
        """Each id below its own side's block count (the sides' counts differ: rare, so not cached)."""
        limit = np.repeat([self.local_blocks, self.remote_blocks] * (len(sizes) // 2), sizes)
        return not np.count_nonzero(flat >= limit)

    def _window(self, sizes: tuple[int, ...]) -> np.ndarray:
        got = self._windows.get(sizes)
        if got is None:
            got = np.repeat(np.arange(len(sizes), dtype=np.int64) * self._width, sizes)
            if len(self._windows) >= _SPREAD_CACHE_SIZE:
                self._windows.pop(next(iter(self._windows)))
            self._windows[sizes] = got
        return got
