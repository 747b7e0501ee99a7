"""Pack mode's canonical staging layout: where each of a producer rank's request bytes sits in its staging.

The producer gathers when it holds the request, before it knows who will read it (their TP and
block sizes), so the order cannot be any one consumer's. It is the producer's own, chosen so that
whatever a consumer rank reads from it is a few contiguous ranges:

- KV first, head slot outermost: (head slot, attention group, tensor, K/V half, kernel block in
  token order); an atom is the valid tokens of one head in one kernel-block half (split layout),
  or of one head in one kernel block, K and V together (interleaved: no half axis). A consumer
  reads whole heads over every token and layer, so its KV share is one range.
- State next, "fine share" outermost: the rank's key heads and value heads split into
  F = gcd(key heads, value heads) shares, share f holding its Q and K channels, its V channels
  and its recurrent-state heads; inside a share (piece of the page, GDN group, tensor). A fan-out
  consumer's channels and value heads are a run of whole shares (its TP divides nk), so its state
  share is one range too.

A fan-out consumer thus reads two ranges per source, a fan-in consumer one. Correctness never
depends on the order: ``map_rows`` splits a consumer's direct rows at atom boundaries and places
each part by its atom, so any tiling of the valid bytes reads correctly, only in more ranges.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout.geometry import ConvLayout, RankGeometry
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.plan.merge import merge_ranges

_EMPTY = np.empty(0, dtype=np.int64)
_SHARE_PIECES: weakref.WeakKeyDictionary[RankGeometry, tuple[np.ndarray, np.ndarray]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class StageLayout:
    """A producer rank's staged bytes of one request: atom i is ``length[i]`` bytes at ``addr[i]``
    (absolute, on the producer), staged at ``offset[i]`` (dense, in this order)."""

    addr: np.ndarray
    length: np.ndarray
    offset: np.ndarray

    @property
    def num_atoms(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class StagedRead:
    """A consumer rank's pack read of one source, against that source's StageLayout.

    Read range i copies ``length[i]`` bytes from ``remote_offset[i]`` of the source's staging to
    ``local_offset[i]`` of this rank's staging (ranges packed back to back, so local staging is
    dense). Scatter piece k then copies ``scatter_length[k]`` bytes from ``scatter_src[k]`` of
    local staging (ascending, dense) to the absolute local address ``scatter_dst[k]``.
    """

    remote_offset: np.ndarray
    local_offset: np.ndarray
    length: np.ndarray
    scatter_src: np.ndarray
    scatter_dst: np.ndarray
    scatter_length: np.ndarray

    @property
    def num_ranges(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())


@dataclass(frozen=True)
class StageShape:
    """The canonical layout of one request shape on one producer rank, block ids left out.

    Atom i sits at ``flat_ids[sel[i]] * page_bytes + const[i]``, ``flat_ids`` being the request's
    block-id lists concatenated in group order; lengths and staging offsets depend on the shape
    only, so a planner builds this once per shape (docs/planner.md#per-request-cost).
    """

    sel: np.ndarray
    const: np.ndarray
    length: np.ndarray
    offset: np.ndarray
    page_bytes: int

    def layout(self, flat_ids: np.ndarray) -> StageLayout:
        """The layout of one request of this shape (``flat_ids``: int64, its lists concatenated)."""
        return StageLayout(flat_ids[self.sel] * self.page_bytes + self.const, self.length, self.offset)


def stage_layout(geometry: RankGeometry, tensor_addrs: Sequence[int], block_ids: Sequence[Sequence[int]],
                 num_tokens: int) -> StageLayout:
    """The canonical layout of one request on one producer rank (see the module docstring).

    Raises:
        PlanError: fewer attention blocks than the tokens need, or a GDN group without exactly one block.
    """
    if num_tokens <= 0:
        return StageLayout(_EMPTY, _EMPTY, _EMPTY)
    arrays = [np.asarray(ids, dtype=np.int64) for ids in block_ids]
    shape = stage_shape(geometry, tensor_addrs, [a.shape[0] for a in arrays], num_tokens)
    return shape.layout(np.concatenate(arrays) if arrays else _EMPTY)


def stage_shape(geometry: RankGeometry, tensor_addrs: Sequence[int], list_lens: Sequence[int],
                num_tokens: int) -> StageShape:
    """``stage_layout``'s shape-only part: ``list_lens`` is each group's block-id list length.

    Raises:
        PlanError: as ``stage_layout``.
    """
    if num_tokens <= 0:
        return StageShape(_EMPTY, _EMPTY, _EMPTY, _EMPTY, geometry.page_bytes)
    num_tokens = geometry.moved_token_end(num_tokens)  # a partial kernel page that is not token-major stages whole
    base = np.asarray(tensor_addrs, dtype=np.int64)
    if base.shape[0] != geometry.num_tensors:
        raise PlanError(f"{base.shape[0]} tensor addresses for {geometry.num_tensors} tensors",
                        num_addrs=base.shape[0], num_tensors=geometry.num_tensors)
    groups = geometry.tensor_map.groups
    if len(list_lens) != len(groups):
        raise PlanError(f"{len(list_lens)} block lists for {len(groups)} cache groups", num_lists=len(list_lens))
    start = np.concatenate(([0], np.cumsum(list_lens, dtype=np.int64)[:-1])).astype(np.int64)
    attn = [(int(start[i]), int(list_lens[i])) for i, g in enumerate(groups) if g.kind is LayerKind.ATTENTION]
    gdn = [(int(start[i]), int(list_lens[i])) for i, g in enumerate(groups) if g.kind is LayerKind.GDN]
    # [group, tensor]: a padded group stages nothing on the tensors where it has no layer (None: no padded group).
    tensor_map = geometry.tensor_map
    held = None
    if tensor_map.is_padded:
        held = np.arange(base.shape[0], dtype=np.int64)[None, :] < np.array(tensor_map.group_tensors)[:, None]
    kinds = [g.kind for g in groups]
    kv_sel, kv_const, kv_len = _kv_atoms(geometry, base, attn, num_tokens, _rows_of(held, kinds, LayerKind.ATTENTION))
    st_sel, st_const, st_len = _state_atoms(geometry, base, gdn, _rows_of(held, kinds, LayerKind.GDN))
    length = np.concatenate((kv_len, st_len))
    offset = np.zeros_like(length)
    np.cumsum(length[:-1], out=offset[1:])
    return StageShape(np.concatenate((kv_sel, st_sel)), np.concatenate((kv_const, st_const)), length, offset,
                      geometry.page_bytes)


def _rows_of(held: np.ndarray | None, kinds: list[LayerKind], kind: LayerKind) -> np.ndarray | None:
    """The [group, tensor] rows of ``held`` for the groups of one kind, in group order."""
    return None if held is None else held[[i for i, k in enumerate(kinds) if k is kind]]


def _kept(held: np.ndarray | None, shape: tuple[int, ...], group_axis: int, *arrays: np.ndarray) -> list[np.ndarray]:
    """``arrays`` broadcast to ``shape`` and flattened, without the atoms of (group, tensor) pairs ``held`` leaves out
    (axis ``group_axis`` and the next are group and tensor)."""
    full = [np.broadcast_to(a, shape) for a in arrays]
    if held is None:
        return [np.ascontiguousarray(a).ravel() for a in full]
    expand = (None,) * group_axis + (slice(None), slice(None)) + (None,) * (len(shape) - group_axis - 2)
    mask = np.broadcast_to(held[expand], shape)
    return [a[mask] for a in full]


def _kv_atoms(g: RankGeometry, base: np.ndarray, attn: list[tuple[int, int]],
              n: int, held: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shape (head slot, group, tensor, half, kernel block), flattened; the half axis has length 1 in interleaved.

    ``attn``: (position of the list's first id in the flat ids, list length) per attention group; ``held``:
    [group, tensor], False where a padded group has no layer (no atoms there).
    """
    if not attn:
        return _EMPTY, _EMPTY, _EMPTY
    kb = g.kernel_block_size
    need = g.num_blocks_for_tokens(n)
    for i, (_, count) in enumerate(attn):
        if count < need:
            raise PlanError(f"attention group {i} lists {count} blocks, {n} tokens need {need}",
                            group=i, num_blocks=count, needed=need)
    q = np.arange(-(-n // kb), dtype=np.int64)
    valid = np.minimum(kb, n - q * kb)
    # [group, kernel block]: the block's position in the flat ids; the kernel block's K half, head slot 0,
    # sits at (q % ratio) kernel blocks into that block's page.
    block = np.stack([first + q // g.kernel_ratio for first, _ in attn])
    kconst = (q % g.kernel_ratio) * g.kernel_block_bytes
    heads = np.arange(g.num_kv_heads_local, dtype=np.int64) * g.kv_head_stride
    halves = np.arange(2 // g.kv_halves_per_run, dtype=np.int64) * g.kv_half_stride
    const = (heads[:, None, None, None, None] + kconst[None, None, None, None, :] + base[None, None, :, None, None]
             + halves[None, None, None, :, None])
    shape = (heads.shape[0], len(attn), base.shape[0], halves.shape[0], q.shape[0])
    sel, const, length = _kept(held, shape, 1, block[None, :, None, None, :], const, valid * g.kv_token_stride)
    return sel, const, length


def _state_atoms(g: RankGeometry, base: np.ndarray, gdn: list[tuple[int, int]],
                 held: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Shape (fine share, piece of the page, group, tensor), flattened (``held`` as in ``_kv_atoms``)."""
    if not gdn or not g.has_gdn:
        return _EMPTY, _EMPTY, _EMPTY
    for i, (_, count) in enumerate(gdn):
        if count != 1:
            raise PlanError(f"GDN group {i} lists {count} blocks, a request owns exactly one",
                            group=i, num_blocks=count)
    blocks = np.array([first for first, _ in gdn], dtype=np.int64)
    rel, length = _share_pieces(g)
    shape = (rel.shape[0], rel.shape[1], blocks.shape[0], base.shape[0])
    const = rel[:, :, None, None] + base[None, None, None, :]
    sel, const, length = _kept(held, shape, 2, blocks[None, None, :, None], const, length[:, :, None, None])
    return sel, const, length


def _share_pieces(g: RankGeometry) -> tuple[np.ndarray, np.ndarray]:
    """[share, piece] offsets inside a page and lengths: Q, K, V (each per window row in SD), then ssm.

    Per geometry, computed once (a Python loop over shares and window rows, per request otherwise).
    """
    got = _SHARE_PIECES.get(g)
    if got is None:
        got = _SHARE_PIECES[g] = _compute_share_pieces(g)
    return got


def _compute_share_pieces(g: RankGeometry) -> tuple[np.ndarray, np.ndarray]:
    m = g.model
    num_key = len(g.conv_channel_ranges[0]) // m.linear_key_head_dim
    num_value = len(g.value_heads)
    shares = math.gcd(num_key, num_value)
    isz, w = g.conv_itemsize, g.conv_window
    rows = []
    for f in range(shares):
        row = []
        for seg in range(3):
            width = len(g.conv_channel_ranges[seg]) // shares
            chan = g.conv_segment_channel_offsets[seg] + f * width
            if g.conv_layout is ConvLayout.DS:
                row.append((chan * w * isz, width * w * isz))
            else:
                row.extend(((k * g.conv_dim_local + chan) * isz, width * isz) for k in range(w))
        heads = num_value // shares
        row.append((g.conv_bytes + f * heads * g.ssm_head_bytes, heads * g.ssm_head_bytes))
        rows.append(row)
    arr = np.array(rows, dtype=np.int64)
    offsets, lengths = np.ascontiguousarray(arr[:, :, 0]), np.ascontiguousarray(arr[:, :, 1])
    offsets.flags.writeable = lengths.flags.writeable = False
    return offsets, lengths


def map_rows(layout: StageLayout, local_addr: np.ndarray, remote_addr: np.ndarray, length: np.ndarray,
             tiles: int = 1) -> StagedRead:
    """Turn one source's direct rows into read ranges of its staging and scatter pieces into local memory.

    ``tiles``: the source's tensor count when the rows are tensor-major (a planner's are), which lets
    ``split_rows`` cut one tensor's rows for all; any rows map correctly whatever it is.

    Raises:
        PlanError: a row reaches bytes the layout does not stage, or two rows read the same staged byte.
    """
    n = int(length.shape[0])
    if n == 0:
        return StagedRead(_EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY, _EMPTY)
    la = np.asarray(local_addr, dtype=np.int64)
    ra = np.asarray(remote_addr, dtype=np.int64)
    row, within, stage, plen = split_rows(layout, ra, np.asarray(length, dtype=np.int64), tiles)
    dst = la[row] + within
    remote_offset, local_offset, run_len = read_runs(stage, plen)
    src = np.cumsum(plen) - plen  # local staging holds the runs back to back: dense in stage order
    s_src, s_dst, s_len = merge_ranges(src, dst, plen)
    return StagedRead(remote_offset, local_offset, run_len, s_src, s_dst, s_len)


def split_rows(layout: StageLayout, ra: np.ndarray, ln: np.ndarray,
               tiles: int = 1) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Rows (remote address ``ra``, length ``ln``) cut at atom boundaries, in staging order.

    Returns (row, offset of the part in its row, staging offset, length) per part.

    ``tiles``: how many copies of one block of rows and atoms the input may be, each shifted by a fixed
    address (a source's tensors: the rows come tensor-major, every tensor's atoms and rows alike). When the
    rows and atoms are such copies, only the first copy is cut and the cut is shifted to the others: the
    search per row (60 ns a row: a binary search over 2,400 atoms, its branches mispredicted) then runs on
    327 rows instead of 4,905. Anything else is cut whole; the result is the same either way.

    Raises:
        PlanError: as ``map_rows``.
    """
    n = int(ln.shape[0])
    if layout.num_atoms == 0:
        raise PlanError("rows to read from a source that staged nothing", num_rows=n)
    order = np.argsort(layout.addr, kind="stable")
    a_addr = layout.addr[order]
    a_end = a_addr + layout.length[order]
    a_off = layout.offset[order]
    shift = _tile_shift(a_addr, a_end, ra, ln, tiles)
    cut = None
    if shift is not None:
        k, m = a_addr.shape[0] // tiles, n // tiles
        cut = _cut(a_addr[:k], a_end[:k], ra[:m], ln[:m], strict=False)
    if cut is None:
        row, atom, start, end = _cut(a_addr, a_end, ra, ln, strict=True)
    else:  # the first tile's parts, repeated per tile: row, atom and addresses shifted by the tile's
        row, atom, start, end = cut
        step = np.arange(tiles, dtype=np.int64)[:, None]
        row = (row[None, :] + step * m).ravel()
        atom = (atom[None, :] + step * k).ravel()
        start, end = (start[None, :] + shift[:, None]).ravel(), (end[None, :] + shift[:, None]).ravel()
    stage = a_off[atom] + (start - a_addr[atom])
    by_stage = np.argsort(stage, kind="stable")
    row, start, end, stage = row[by_stage], start[by_stage], end[by_stage], stage[by_stage]
    plen = end - start
    if (stage[1:] < stage[:-1] + plen[:-1]).any():
        raise PlanError("two rows read the same staged bytes", num_rows=n)
    return row, start - ra[row], stage, plen


def _tile_shift(a_addr: np.ndarray, a_end: np.ndarray, ra: np.ndarray, ln: np.ndarray,
                tiles: int) -> np.ndarray | None:
    """Each tile's address shift from the first when the sorted atoms and the rows are ``tiles`` shifted
    copies of their first tile, the tiles' atoms apart; else None."""
    n, num_atoms = ra.shape[0], a_addr.shape[0]
    if tiles <= 1 or n % tiles or num_atoms % tiles:
        return None
    k, m = num_atoms // tiles, n // tiles
    shift = a_addr[::k] - a_addr[0]
    atoms = a_addr.reshape(tiles, k) - shift[:, None]
    ends = a_end.reshape(tiles, k) - shift[:, None]
    rows = ra.reshape(tiles, m) - shift[:, None]
    if not ((atoms == atoms[0]).all() and (ends == ends[0]).all() and (rows == rows[0]).all()
            and (ln.reshape(tiles, m) == ln[:m]).all() and (a_addr[k::k] >= a_end[k - 1:-1:k]).all()):
        return None
    return shift


def _cut(a_addr: np.ndarray, a_end: np.ndarray, ra: np.ndarray, ln: np.ndarray,
         strict: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Rows cut at the (sorted, disjoint) atoms: (row, atom, start, end) per part, in row order.

    Raises:
        PlanError: when ``strict``, a row reaching bytes no atom holds (None instead otherwise).
    """
    n = ra.shape[0]
    first = np.searchsorted(a_addr, ra, side="right") - 1
    row_end = ra + ln
    f0 = np.maximum(first, 0)
    inside = row_end <= a_end[f0]  # most rows lie in one atom: the second search only for the others
    if inside.all():
        last = first
    else:
        last = first.copy()
        out = np.flatnonzero(~inside)
        last[out] = np.searchsorted(a_addr, row_end[out] - 1, side="right") - 1
    bad = (ln <= 0) | (first < 0) | (ra >= a_end[f0]) | (row_end > a_end[np.maximum(last, 0)])
    if bad.any():
        if not strict:
            return None
        i = int(np.flatnonzero(bad)[0])
        raise PlanError(f"row {i} ({int(ln[i])} B at {int(ra[i]):#x}) reaches bytes the source does not stage",
                        row=i, remote_addr=int(ra[i]), length=int(ln[i]))
    if last is first:
        return np.arange(n, dtype=np.int64), first, ra, row_end
    count = last - first + 1
    row = np.repeat(np.arange(n, dtype=np.int64), count)
    within = np.arange(row.shape[0], dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    atom = first[row] + within
    start = np.maximum(ra[row], a_addr[atom])
    end = np.minimum(row_end[row], a_end[atom])
    gap = (row[1:] == row[:-1]) & (end[:-1] != start[1:])
    if gap.any():
        if not strict:
            return None
        i = int(row[1:][gap][0])
        raise PlanError(f"row {i} ({int(ln[i])} B at {int(ra[i]):#x}) spans bytes the source does not stage",
                        row=i, remote_addr=int(ra[i]), length=int(ln[i]))
    return row, atom, start, end


def read_runs(stage: np.ndarray, plen: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Parts in staging order joined into maximal contiguous runs: (remote offset, local offset, length)."""
    new = np.concatenate(([True], stage[1:] != stage[:-1] + plen[:-1]))
    starts = np.flatnonzero(new)
    run_len = np.add.reduceat(plen, starts)
    return stage[starts], np.cumsum(run_len) - run_len, run_len
