"""Direct rows of a step's requests in one numpy pass, and the step's checks in a handful more.

A request's plan is small (a few dozen pieces broadcast over the shared tensors), so its cost is numpy
call overhead, about a microsecond a call, not the arithmetic. Here every request's pieces (its shape's
Recipe over its block ids) are laid end to end, sorted once by (request, local offset), merged once and
broadcast over the tensors' base addresses with one gather; each request's SourcePlans are slices of the
batch's columns. The rows, and their order, are those each request gets planned alone: per request, per
source in template order, tensor-major (what ``Planner.plan`` returned before this pass existed).

The checks here only say yes or no, and are strict: a step they do not pass is checked again by the exact
per-request functions (plan/batch_checks.py, plan/validate.py), which name the error. The ids are checked
per step (``IdCheck``); the rows are not checked per request at all: what ``validate_plan`` asks of them
follows from the ids and from their shape's pieces, checked once per shape (``Fit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

from hybrid_transfer.plan.pieces import Recipe
from hybrid_transfer.plan.templates import SOURCE_MASK, SOURCE_SHIFT

_SPREAD_CACHE_SIZE = 256


_min, _max = np.minimum.reduce, np.maximum.reduce  # ndarray.min() and max() add a Python frame


@dataclass(frozen=True)
class Broadcast:
    """What the rows need of a planner, fixed at its construction."""

    bases: np.ndarray  # [2, tensor, 1]: each tensor's local base address, and its first source's
    remote_base: np.ndarray  # [tensor, source]
    pages: np.ndarray  # [[local page bytes], [remote page bytes]]
    num_sources: int
    padded: bool  # some group is not on every tensor: rows carry their tensor count (Recipe.tensors)

    @property
    def num_tensors(self) -> int:
        return self.bases.shape[1]

    local_region: int  # bytes of a local tensor's region: its offsets are below it

    @property
    def request_shift(self) -> int:
        """Bit of the request tag in a sort key: above the local offsets and their source tag."""
        return SOURCE_SHIFT + self.num_sources.bit_length()

    @property
    def max_tagged(self) -> int:
        """The most requests a sort key can tag (0 when local offsets reach the source tag's bits)."""
        return 0 if self.local_region >> SOURCE_SHIFT else (1 << (63 - self.request_shift)) - 1


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


@dataclass(frozen=True)
class Fit:
    """What every request of one shape's rows satisfy, found once per shape, so no request checks its rows.

    With its ids in range and unique (``IdCheck``), a request's rows lie in its blocks' pages and never
    overlap when every piece lies inside its page on both sides and apart from the other pieces of its local
    block: a row is a run of pieces of one block pair, distinct local ids are distinct pages, and distinct
    tensors are disjoint regions (``Planner._row_shortcut``). The tail pieces (``Recipe.tail``) take each
    token end's length: any length in (0, ``room``] keeps them so. Bytes: ``fixed_bytes`` plus the tail's
    length times ``tail_weight`` (pieces times the tensors each lies on; merging keeps the sum)."""

    room: int  # -1: a piece other than the tail's is outside its page, empty, or on another one
    fixed_bytes: int
    tail_weight: int

    def holds(self, head: int, expected_bytes: int) -> bool:
        """A request of this shape whose tail pieces are ``head`` bytes long passes ``validate_plan``."""
        return 0 < head <= self.room and self.fixed_bytes + head * self.tail_weight == expected_bytes


def fit(rec: Recipe, pages: np.ndarray, num_tensors: int) -> Fit:
    """``rec``'s Fit (``pages``: [[local page bytes], [remote page bytes]]); ``rec`` is stacked."""
    n = rec.length.shape[0]
    weight = np.full(n, num_tensors, dtype=np.int64) if rec.tensors is None else rec.tensors
    tail = np.zeros(n, dtype=bool)
    tail[rec.tail] = True
    const = rec.const2 & SOURCE_MASK  # a source's tag on local offsets, a tensor count's on remote ones
    end = const + rec.length
    fixed = ~tail
    fine = bool((const >= 0).all() and (end[:, fixed] <= pages).all() and (rec.length[fixed] > 0).all())
    room = (pages - const[:, tail]).min(initial=1 << 62)
    # Apart: in each local block's pieces by offset, every piece ends before the next one starts.
    order = np.lexsort((const[0], rec.sel2[0]))
    block, start, length, last = rec.sel2[0][order], const[0][order], rec.length[order], tail[order]
    same = block[1:] == block[:-1]
    gap = start[1:] - start[:-1]
    fine = fine and bool((length[:-1][same & ~last[:-1]] <= gap[same & ~last[:-1]]).all())
    room = min(int(room), int(gap[same & last[:-1]].min(initial=1 << 62)))
    return Fit(room if fine else -1, int((rec.length * weight)[fixed].sum()), int(weight[tail].sum()))


def stacked(rec: Recipe, local_len: int, num_tensors: int, pages: np.ndarray) -> Recipe:
    """``rec`` with its two sides as [2, piece] arrays indexing one request's local and remote ids laid end to
    end (``local_len`` local ids first), the padded-tensor tag folded into the remote constants, so both
    sides take one gather, one multiply and one add; and with its Fit."""
    remote_const = rec.remote_const
    if rec.tensors is not None:  # pieces on different tensor counts never merge (Planner._merge)
        remote_const = remote_const + ((num_tensors - rec.tensors) << SOURCE_SHIFT)
    out = Recipe(rec.local_sel, rec.local_const, rec.remote_sel, rec.remote_const, rec.length, rec.key, rec.tail,
                 rec.tensors, np.stack((rec.local_sel, rec.remote_sel + local_len)),
                 np.stack((rec.local_const, remote_const)), int(rec.length[rec.tail[0]]) if rec.tail.shape[0] else 0)
    return Recipe(*(getattr(out, f) for f in _RECIPE_FIELDS[:-1]), fit(out, pages, num_tensors))


_RECIPE_FIELDS = tuple(Recipe.__dataclass_fields__)


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
        if len(jobs) <= bc.max_tagged:
            order = (offs[0] + np.repeat(_request_tags(len(jobs), bc.request_shift), counts)).argsort(kind="stable")
        else:  # a request tag would not fit above the offsets: sort on (request, offset) pairs
            order = np.lexsort((offs[0], np.repeat(np.arange(len(jobs), dtype=np.int64), counts)))
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


def _request_tags(count: int, shift: int) -> np.ndarray:
    """Each request's tag in a sort key (its index at bit ``shift``), for the first ``count`` requests."""
    tags = _TAGS.get(shift)
    if tags is None or tags.shape[0] < count:
        tags = _TAGS[shift] = np.arange(max(count, 256), dtype=np.int64) << shift
    return tags[:count]


_TAGS: dict[int, np.ndarray] = {}


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
        idx, col, tensor = self._gather(tuple(b - a for a, b in zip(seg, seg[1:], strict=False)), t)
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
        if len(sizes) == 2:  # one request: its range read off the sorted ids, without a max over them
            keyed = flat + self._window(sizes)
            keyed.sort()
            nl = sizes[0]
            # Every id >= 0, so remote ids key at >= width: the nl smallest are the local ids, the rest remote.
            if (nl and keyed[nl - 1] >= self.local_blocks) or (sizes[1] and keyed[-1] >= self._width + self.remote_blocks):
                return False
            return not np.count_nonzero(keyed[1:] == keyed[:-1])
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
