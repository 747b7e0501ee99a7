"""Pack plans per segment structure: everything of a source's pack plan that the block ids do not change.

A source's staging (plan/stage_layout.py) orders atoms by head, group, tensor, half and kernel
block, never by block id, so where each byte a consumer reads sits in the staging (its read ranges,
the order and lengths of its scatter pieces) depends only on the request's shape. Only the atoms'
source addresses and the scatter pieces' local addresses follow the ids: one gather and one
multiply-add each, plus joining the pieces the ids make contiguous (docs/planner.md#per-request-cost).

Token counts with the same segment structure (``pieces.last_cut``) differ only in the last segment's
length: its atoms and pieces grow by a fixed number of bytes per token and everything staged after
them moves by a multiple of that, so one recipe serves them all as (values at a reference count,
whole bytes per token): ``structure_recipe``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybrid_transfer.errors import PlanError
from hybrid_transfer.plan.pieces import Recipe
from hybrid_transfer.plan.stage_layout import StagedRead, StageShape, read_runs, split_rows, stage_shape
from hybrid_transfer.plan.templates import SOURCE_MASK, SOURCE_SHIFT, SourceTemplate
from hybrid_transfer.plan.types import PackSourcePlan, SourcePlan


def _frozen(a: np.ndarray) -> np.ndarray:
    """Shared by every plan of a shape: read-only, so no caller edits another plan's arrays."""
    a = np.ascontiguousarray(a, dtype=np.int64)
    a.flags.writeable = False
    return a


@dataclass(frozen=True)
class PackRecipe:
    """One source's pack plan for one request shape.

    ``read_*`` are the read ranges (remote offset, local offset, length), final. Scatter piece k
    copies ``scatter_length[k]`` bytes from ``scatter_src[k]`` of local staging to
    ``flat_local_ids[scatter_sel[k]] * local_page + scatter_const[k]``; pieces that always join
    (same local block, contiguous) are joined already, the others join when the ids make them
    contiguous, exactly as ``map_rows`` joins them.
    """

    stage: StageShape
    read_remote: np.ndarray
    read_local: np.ndarray
    read_length: np.ndarray
    scatter_src: np.ndarray
    scatter_sel: np.ndarray
    scatter_const: np.ndarray
    scatter_length: np.ndarray
    local_page: int
    num_tokens: int = 0  # the count these arrays are for
    slope: PackSlope | None = None  # per-token change of the arrays that follow the count (None: one count only)

    def pack(self, direct: SourcePlan, flat_local: np.ndarray, flat_remote: np.ndarray,
             num_tokens: int | None = None) -> PackSourcePlan:
        """The pack plan of one request of this shape (``flat_*``: its int64 id lists concatenated).

        ``num_tokens``: the request's count, any of the structure's when the recipe has a slope.
        """
        rec = self if num_tokens is None else self.at(num_tokens)
        stage, src, length = rec.stage, rec.scatter_src, rec.scatter_length
        read = (rec.read_remote, rec.read_local, rec.read_length)
        dst = flat_local[self.scatter_sel] * self.local_page + self.scatter_const
        if dst.shape[0] > 1:
            brk = dst[1:] != dst[:-1] + length[:-1]
            if not brk.all():
                starts = np.concatenate(([0], np.flatnonzero(brk) + 1))
                src, dst, length = src[starts], dst[starts], np.add.reduceat(length, starts)
        return PackSourcePlan(direct, stage.layout(flat_remote), StagedRead(*read, src, dst, length))

    def at(self, num_tokens: int) -> PackRecipe:
        """This recipe at another count of its structure (itself at its own count, or without a slope)."""
        d = num_tokens - self.num_tokens
        if not d or self.slope is None:
            return self
        k, st = self.slope, self.stage
        # Every sloped array in one multiply-add (13,116 values at 131,072 tokens P2 -> D8: 6 us, against
        # 25-30 us as seven pairs of numpy calls), then views of it; read-only like the recipe's own arrays.
        values = k.step * (num_tokens - k.num_tokens)
        values += k.base
        values.flags.writeable = False
        s_len, s_off, r_rem, r_loc, r_len, c_src, c_len = (values[a:b] for a, b in k.spans)
        return PackRecipe(StageShape(st.sel, st.const, s_len, s_off, st.page_bytes), r_rem, r_loc, r_len, c_src,
                          self.scatter_sel, self.scatter_const, c_len, self.local_page, num_tokens, k)

    def with_slope(self, other: PackRecipe) -> PackRecipe | None:
        """This recipe keyed by structure, given ``other``, the same source's recipe at another count of it.

        None unless every array has the same shape in both, the id parts (atoms' and pieces' positions
        and constants) are equal, and every other array changes by whole bytes per token.
        """
        dn = other.num_tokens - self.num_tokens
        if dn == 0 or self.local_page != other.local_page or self.stage.page_bytes != other.stage.page_bytes:
            return None
        fixed = ((self.stage.sel, other.stage.sel), (self.stage.const, other.stage.const),
                 (self.scatter_sel, other.scatter_sel), (self.scatter_const, other.scatter_const))
        if any(a.shape != b.shape or not np.array_equal(a, b) for a, b in fixed):
            return None
        bases, steps = [], []
        for name in _SLOPED:
            a, b = _field(self, name), _field(other, name)
            if a.shape != b.shape:
                return None
            step, rem = np.divmod(b - a, dn)
            if rem.any():
                return None
            bases.append(a)
            steps.append(step)
        ends = np.cumsum([a.shape[0] for a in bases]).tolist()
        slope = PackSlope(_frozen(np.concatenate(bases)), _frozen(np.concatenate(steps)),
                          tuple(zip([0, *ends[:-1]], ends, strict=True)), self.num_tokens)
        return PackRecipe(self.stage, self.read_remote, self.read_local, self.read_length, self.scatter_src,
                          self.scatter_sel, self.scatter_const, self.scatter_length, self.local_page,
                          self.num_tokens, slope)


@dataclass(frozen=True)
class PackSlope:
    """A PackRecipe's count-dependent arrays (``_SLOPED``) concatenated, at count ``num_tokens`` (``base``) and
    in bytes per token (``step``); ``spans[i]`` is where array i lies in both."""

    base: np.ndarray
    step: np.ndarray
    spans: tuple[tuple[int, int], ...]
    num_tokens: int


# The arrays that follow the count, in PackSlope order: "stage_*" are the StageShape's.
_SLOPED = ("stage_length", "stage_offset", "read_remote", "read_local", "read_length", "scatter_src",
           "scatter_length")


def _field(rec: PackRecipe, name: str) -> np.ndarray:
    return getattr(rec.stage, name[len("stage_"):]) if name.startswith("stage_") else getattr(rec, name)


def structure_recipe(build: Callable[[int], PackRecipe], cut: int, end: int) -> PackRecipe | None:
    """One source's recipe for every count in (cut, end], the counts of one segment structure.

    ``build(n)`` is the recipe at count n. Built at two counts inside the structure (its first, and
    the one before its last, where a full last kernel block could join pieces no other count joins),
    the arrays give the slope; None when they do not (the caller keys on the exact count instead).
    Between the two the layouts cannot differ in kind: a gap in the staging is bytes of atoms a reader
    skips, never zero, and a join the ids do not decide holds for one count at most, which the
    request's own join (``pack``) redoes.
    """
    first = cut + 1
    second = end - 1 if end - 1 > first else end
    one = build(first)
    return one if second == first else one.with_slope(build(second))


def pack_recipe(rec: Recipe, index: int, tpl: SourceTemplate, local_base: np.ndarray, local_page: int,
                remote_page: int, remote_lens: tuple[int, ...], num_tokens: int) -> PackRecipe:
    """Source ``index``'s pack recipe from the shape's (unmerged, coalesced-mode) Recipe.

    The parts are found as ``map_rows`` finds them, on stand-in addresses: block id i at flat position
    i, each tensor far from the others. For any valid request (distinct ids) a byte's atom and place
    in it are the same, so the staging offsets, and hence the plan, are those of the real addresses.

    Raises:
        PlanError: the rows reach bytes the source does not stage, or read a staged byte twice
            (a bug on one side), or the read ranges do not hold the rows' bytes.
    """
    mine = (rec.local_const >> SOURCE_SHIFT) == index
    lsel, lconst = rec.local_sel[mine], rec.local_const[mine] & SOURCE_MASK
    rsel, rconst, length = rec.remote_sel[mine], rec.remote_const[mine], rec.length[mine]
    geo = tpl.geometry
    num_tensors = local_base.shape[0]
    flat_len = int(sum(remote_lens))
    span = (flat_len + 1) * max(remote_page, geo.page_bytes)
    stand_in = np.arange(geo.num_tensors, dtype=np.int64) * span
    fake_shape = stage_shape(geo, stand_in, remote_lens, num_tokens)
    fake = fake_shape.layout(np.arange(flat_len, dtype=np.int64))
    # The real shape: each atom's stand-in tensor base (const // span: offsets in a page are below span)
    # swapped for the tensor's real base.
    tensor = fake_shape.const // span
    stage = StageShape(fake_shape.sel, fake_shape.const - stand_in[tensor] + tpl.tensor_addrs[tensor],
                       fake_shape.length, fake_shape.offset, fake_shape.page_bytes)
    # Rows tensor-major, as the direct plan's; a padded group's pieces only on the tensors holding its layers.
    held = (np.ones((num_tensors, length.shape[0]), dtype=bool) if rec.tensors is None
            else np.arange(num_tensors, dtype=np.int64)[:, None] < rec.tensors[mine][None, :])
    ra = (stand_in[:num_tensors, None] + (rsel * remote_page + rconst)[None, :])[held]
    ln = np.broadcast_to(length, held.shape)[held]
    row, within, staged, plen = split_rows(fake, ra, ln, num_tensors if rec.tensors is None else 1)
    read_remote, read_local, read_length = read_runs(staged, plen)
    if int(read_length.sum()) != int(ln.sum()):
        raise PlanError(f"source {tpl.source_rank}: read ranges hold {int(read_length.sum())} B of the rows' "
                        f"{int(ln.sum())} B", source_rank=tpl.source_rank)
    src = np.cumsum(plen) - plen
    sel = np.broadcast_to(lsel, held.shape)[held][row]
    const = (local_base[:, None] + lconst[None, :])[held][row] + within
    joined = np.concatenate(([False], (sel[1:] == sel[:-1]) & (const[1:] == const[:-1] + plen[:-1])))
    starts = np.flatnonzero(~joined)
    return PackRecipe(stage=StageShape(*(_frozen(a) for a in (stage.sel, stage.const, stage.length, stage.offset)),
                                       stage.page_bytes),
                      read_remote=_frozen(read_remote), read_local=_frozen(read_local),
                      read_length=_frozen(read_length), scatter_src=_frozen(src[starts]),
                      scatter_sel=_frozen(sel[starts]), scatter_const=_frozen(const[starts]),
                      scatter_length=_frozen(np.add.reduceat(plen, starts)), local_page=local_page,
                      num_tokens=num_tokens)
