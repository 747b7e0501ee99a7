"""Per-request pieces of one source, as byte offsets relative to a shared tensor's start.

Layer j of every group lives on tensor j at the same offsets, so pieces are
built (and merged) once for "a tensor" and broadcast over the tensors' base
addresses at the end. KV token ranges are cut at every local and every remote
kernel-block boundary, each side indexing its own block-id list with its own
block and kernel block sizes (never the other side's ratio).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout.geometry import RankGeometry
from hybrid_transfer.plan.templates import KVTemplate, StateTemplate

_GROUP_KEY = 1 << 40  # naive-mode keys of different groups never collide


@dataclass(frozen=True)
class SegmentFrame:
    """Token segments of [0, num_tokens) cut at every kernel-block boundary of either side.

    ``*_block`` index a side's block-id list; ``*_const`` is the segment start's
    offset inside that logical block (kernel block and token, head 0, K half).
    ``head_bytes`` is one head's run over the segment's tokens: K (or V) only in
    split, K and V together in interleaved.
    """

    num_tokens: int
    local_block: np.ndarray
    local_const: np.ndarray
    remote_block: np.ndarray
    remote_const: np.ndarray
    head_bytes: np.ndarray  # bytes of one head's tokens in the segment

    @property
    def num_segments(self) -> int:
        return int(self.head_bytes.shape[0])


def segment_frame(num_tokens: int, local: RankGeometry, remote: RankGeometry, first_token: int = 0) -> SegmentFrame:
    """Cut [first_token, num_tokens) at multiples of both kernel block sizes (logical blocks end on those too).

    ``num_tokens`` is the end of the token range to move: the request's tokens, or for naive mode
    the end of the last page both sides hold (``naive_token_end``). ``first_token`` is where it starts: 0, or
    the end of a decode-side prefix hit (docs/planner.md#prefix-hits). Block positions stay absolute: each
    side indexes its whole block-id list.
    """
    n, s = num_tokens, first_token
    kb_l, kb_r = local.kernel_block_size, remote.kernel_block_size
    cuts = np.union1d(np.arange((s // kb_l + 1) * kb_l, n, kb_l, dtype=np.int64),
                      np.arange((s // kb_r + 1) * kb_r, n, kb_r, dtype=np.int64))
    t0 = np.concatenate((np.array([s], dtype=np.int64), cuts)) if n > s else np.empty(0, dtype=np.int64)
    t1 = np.concatenate((cuts, np.array([n], dtype=np.int64))) if n > s else np.empty(0, dtype=np.int64)

    def side(geo: RankGeometry) -> tuple[np.ndarray, np.ndarray]:
        block = t0 // geo.block_size
        within = t0 - block * geo.block_size
        kidx = within // geo.kernel_block_size
        tok = within - kidx * geo.kernel_block_size
        return block, kidx * geo.kernel_block_bytes + tok * geo.kv_token_stride

    lb, lc = side(local)
    rb, rc = side(remote)
    return SegmentFrame(n, lb, lc, rb, rc, (t1 - t0) * local.kv_token_stride)


def last_cut(num_tokens: int, local: RankGeometry, remote: RankGeometry, first_token: int = 0) -> int:
    """Start of ``segment_frame(num_tokens, ..., first_token)``'s last segment: the largest kernel-block boundary
    of either side below ``num_tokens``, or ``first_token`` when that is later (0 when there is none).

    Token ends with the same last cut share every segment but the last one's length, so they share a
    Recipe up to ``Recipe.with_tail`` (docs/planner.md#per-request-cost).
    """
    if num_tokens <= first_token:
        return first_token
    kb_l, kb_r = local.kernel_block_size, remote.kernel_block_size
    return max((num_tokens - 1) // kb_l * kb_l, (num_tokens - 1) // kb_r * kb_r, first_token)


def structure_end(cut: int, local: RankGeometry, remote: RankGeometry) -> int:
    """The last token end whose ``last_cut`` is ``cut``: the next kernel-block boundary of either side.

    The counts of one segment structure are (cut, structure_end(cut)].
    """
    return min((cut // kb + 1) * kb for kb in (local.kernel_block_size, remote.kernel_block_size))


def naive_token_end(num_tokens: int, local: RankGeometry, remote: RankGeometry) -> int:
    """Where naive mode stops: the end of the request's last logical page on the side whose pages end first.

    vLLM moves whole pages, the unused tail of the last one included; a tail beyond the other
    side's last page has nowhere to land, so the shorter side bounds it.
    """
    if num_tokens <= 0:
        return 0
    return min(local.num_blocks_for_tokens(num_tokens) * local.block_size,
               remote.num_blocks_for_tokens(num_tokens) * remote.block_size)


@dataclass
class Pieces:
    """Relative (per-tensor) pieces of one source for one request; ``key`` only in naive mode."""

    local_off: np.ndarray
    remote_off: np.ndarray
    length: np.ndarray
    key: np.ndarray | None


@dataclass(frozen=True)
class Recipe:
    """Every unmerged piece of a request shape, as (block id position, constant) per side.

    A piece's offset on a side is ``flat_ids[sel] * page + const``, where ``flat_ids`` is that side's
    block-id lists concatenated in group order. Everything but the ids depends only on the shape
    (the frame's segments, list lengths, mode) and the last segment's length, so the planner builds
    this once per shape, patches ``tail`` per token end (``with_tail``), and a request costs two
    gathers and two multiply-adds (docs/planner.md#per-request-cost).
    """

    local_sel: np.ndarray
    local_const: np.ndarray
    remote_sel: np.ndarray
    remote_const: np.ndarray
    length: np.ndarray
    key: np.ndarray | None  # naive mode only
    tail: np.ndarray  # positions of the pieces cut from the frame's last segment (all of one length)
    # Per piece, how many tensors (0 .. n-1) hold a layer of its group; None when every group is on every tensor.
    # A padded group (docs/layout.md#padded-groups) has no layer, and nothing to move, on the tensors past it.
    tensors: np.ndarray | None = None
    # Both sides as [2, piece] arrays over one request's local and remote ids laid end to end (the planner's
    # batch_rows.stacked): one gather, multiply and add for the two sides.
    sel2: np.ndarray | None = None
    const2: np.ndarray | None = None
    head: int = 0  # the tail pieces' length
    fit: object = None  # batch_rows.Fit: what the rows of any request of this shape are sure to satisfy

    def with_tail(self, head_bytes: int) -> Recipe:
        """This recipe for another token end with the same segments (``last_cut``): only the last segment's
        pieces change, to ``head_bytes`` each. Merging runs per request on the lengths, so it follows."""
        if not self.tail.shape[0] or int(self.length[self.tail[0]]) == head_bytes:
            return self
        length = self.length.copy()
        length[self.tail] = head_bytes
        # The constructor, not dataclasses.replace, which walks the fields: 1.3 us against 2.3, every request.
        return Recipe(self.local_sel, self.local_const, self.remote_sel, self.remote_const, length, self.key,
                      self.tail, self.tensors, self.sel2, self.const2, head_bytes, self.fit)

    def pieces(self, local_ids: np.ndarray, remote_ids: np.ndarray, local_page: int, remote_page: int) -> Pieces:
        """This shape's pieces for one request's flat block-id arrays."""
        return Pieces(local_ids[self.local_sel] * local_page + self.local_const,
                      remote_ids[self.remote_sel] * remote_page + self.remote_const, self.length, self.key)


def recipe(frame: SegmentFrame, kv: KVTemplate, st: StateTemplate, attn_groups: Sequence[int],
           gdn_groups: np.ndarray, local_lens: Sequence[int], remote_lens: Sequence[int], with_key: bool,
           group_tensors: Sequence[int] | None = None) -> Recipe:
    """The pieces of one request shape (``*_lens``: each group's block-id list length on that side).

    ``group_tensors``: per group, the tensors holding one of its layers, when some group is padded (the
    recipe's ``tensors`` then says, per piece, onto how many tensors it broadcasts).

    KV: one piece per (attention group, segment, half, head slot), segment-major; a segment's start
    (head 0, K half) is the ``frame.*_block``-th block of the group plus ``frame.*_const``. The naive
    key is (group, segment, half): a segment lies in one source kernel page and one destination kernel
    page, so merging equal keys gives vLLM's one descriptor per (slot, source page, destination page).
    State: every GDN group's single block, one piece per state template row.

    Raises:
        PlanError: too few blocks in an attention group's list, or a GDN group's list not holding exactly
            one block (validation says so first, with the finer error).
    """
    l_start = np.concatenate(([0], np.cumsum(local_lens, dtype=np.int64)[:-1]))
    r_start = np.concatenate(([0], np.cumsum(remote_lens, dtype=np.int64)[:-1]))
    sel_l, const_l, sel_r, const_r, length, key, tail, tensors = [], [], [], [], [], [], [], []
    c = kv.half.shape[0]
    per_group = frame.num_segments * c
    if c:
        seg_idx = np.arange(frame.num_segments, dtype=np.int64)
        for g in attn_groups:
            if frame.num_segments and (frame.local_block[-1] >= local_lens[g] or frame.remote_block[-1] >= remote_lens[g]):
                raise PlanError(f"group {g} lists {local_lens[g]} local and {remote_lens[g]} remote blocks, too few for "
                                f"{frame.num_tokens} tokens", group=g, local=local_lens[g], remote=remote_lens[g])
            sel_l.append(np.repeat(frame.local_block + l_start[g], c))
            sel_r.append(np.repeat(frame.remote_block + r_start[g], c))
            const_l.append((frame.local_const[:, None] + kv.local_const[None, :]).ravel())
            const_r.append((frame.remote_const[:, None] + kv.remote_const[None, :]).ravel())
            length.append(np.repeat(frame.head_bytes, c))
            key.append((seg_idx[:, None] * 2 + kv.half[None, :]).ravel() + g * _GROUP_KEY)
            if group_tensors is not None:
                tensors.append(np.full(per_group, group_tensors[g], dtype=np.int64))
            if per_group:  # segment-major: the group's last c pieces are its last segment's
                end = len(length) * per_group
                tail.append(np.arange(end - c, end, dtype=np.int64))
    r = st.length.shape[0]
    if r and gdn_groups.shape[0]:
        bad = [int(g) for g in gdn_groups if local_lens[g] != 1 or remote_lens[g] != 1]
        if bad:
            raise PlanError(f"GDN groups {bad} must each list exactly one block on both sides", groups=bad)
        n = gdn_groups.shape[0]
        sel_l.append(np.repeat(l_start[gdn_groups], r))
        sel_r.append(np.repeat(r_start[gdn_groups], r))
        const_l.append(np.tile(st.local_off, n))
        const_r.append(np.tile(st.remote_off, n))
        length.append(np.tile(st.length, n))
        key.append((gdn_groups[:, None] * _GROUP_KEY + st.key[None, :]).ravel())
        if group_tensors is not None:
            tensors.append(np.repeat(np.asarray(group_tensors, dtype=np.int64)[gdn_groups], r))

    def cat(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.empty(0, dtype=np.int64)

    return Recipe(cat(sel_l), cat(const_l), cat(sel_r), cat(const_r), cat(length), cat(key) if with_key else None,
                  cat(tail), cat(tensors) if group_tensors is not None else None)
