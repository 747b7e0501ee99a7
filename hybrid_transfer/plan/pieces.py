"""Per-request pieces of one source, as byte offsets relative to a shared tensor's start.

Layer j of every group lives on tensor j at the same offsets, so pieces are
built (and merged) once for "a tensor" and broadcast over the tensors' base
addresses at the end. KV token ranges are cut at every local and every remote
kernel-block boundary, each side indexing its own block-id list with its own
block and kernel block sizes (never the other side's ratio).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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


def segment_frame(num_tokens: int, local: RankGeometry, remote: RankGeometry) -> SegmentFrame:
    """Cut [0, num_tokens) at multiples of both kernel block sizes (logical blocks end on those too).

    ``num_tokens`` is the end of the token range to move: the request's tokens, or for naive mode
    the end of the last page both sides hold (``naive_token_end``).
    """
    n = num_tokens
    kb_l, kb_r = local.kernel_block_size, remote.kernel_block_size
    cuts = np.union1d(np.arange(kb_l, n, kb_l, dtype=np.int64), np.arange(kb_r, n, kb_r, dtype=np.int64))
    t0 = np.concatenate((np.zeros(1, dtype=np.int64), cuts)) if n > 0 else np.empty(0, dtype=np.int64)
    t1 = np.concatenate((cuts, np.array([n], dtype=np.int64))) if n > 0 else np.empty(0, dtype=np.int64)

    def side(geo: RankGeometry) -> tuple[np.ndarray, np.ndarray]:
        block = t0 // geo.block_size
        within = t0 - block * geo.block_size
        kidx = within // geo.kernel_block_size
        tok = within - kidx * geo.kernel_block_size
        return block, kidx * geo.kernel_block_bytes + tok * geo.kv_token_stride

    lb, lc = side(local)
    rb, rc = side(remote)
    return SegmentFrame(n, lb, lc, rb, rc, (t1 - t0) * local.kv_token_stride)


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


def segment_offsets(frame: SegmentFrame, local_ids: np.ndarray, remote_ids: np.ndarray, local_page: int,
                    remote_page: int) -> tuple[np.ndarray, np.ndarray]:
    """Each segment's start (head 0, K half) relative to a tensor, on each side: the block-id arithmetic."""
    return (local_ids[frame.local_block] * local_page + frame.local_const,
            remote_ids[frame.remote_block] * remote_page + frame.remote_const)


def kv_pieces(frame: SegmentFrame, kv: KVTemplate, seg_l: np.ndarray, seg_r: np.ndarray, group: int,
              with_key: bool) -> Pieces:
    """One piece per (segment, half, head slot) of one attention group, segment-major.

    The naive key is (group, segment, half): a segment lies in one source kernel page and one
    destination kernel page, so merging equal keys gives vLLM's one descriptor per (slot, source
    page, destination page), heads merged where they are one range on both sides.
    """
    c = kv.half.shape[0]
    loc = (seg_l[:, None] + kv.local_const[None, :]).ravel()
    rem = (seg_r[:, None] + kv.remote_const[None, :]).ravel()
    length = np.repeat(frame.head_bytes, c)
    key = None
    if with_key:
        seg_idx = np.arange(frame.num_segments, dtype=np.int64)
        key = (seg_idx[:, None] * 2 + kv.half[None, :]).ravel() + group * _GROUP_KEY
    return Pieces(loc, rem, length, key)


def state_pieces(st: StateTemplate, local_ids: np.ndarray, remote_ids: np.ndarray, local_page: int,
                 remote_page: int, groups: np.ndarray, with_key: bool) -> Pieces:
    """Every GDN group's state pieces at once: ``local_ids[i]`` is group ``groups[i]``'s single block."""
    loc = (local_ids[:, None] * local_page + st.local_off[None, :]).ravel()
    rem = (remote_ids[:, None] * remote_page + st.remote_off[None, :]).ravel()
    length = np.broadcast_to(st.length, (local_ids.shape[0], st.length.shape[0])).ravel()
    key = (groups[:, None] * _GROUP_KEY + st.key[None, :]).ravel() if with_key else None
    return Pieces(loc, rem, length, key)


def concat(parts: list[Pieces], with_key: bool) -> Pieces:
    if not parts:
        e = np.empty(0, dtype=np.int64)
        return Pieces(e, e, e, e if with_key else None)
    if len(parts) == 1:
        return parts[0]
    return Pieces(
        np.concatenate([p.local_off for p in parts]),
        np.concatenate([p.remote_off for p in parts]),
        np.concatenate([p.length for p in parts]),
        np.concatenate([p.key for p in parts]) if with_key else None,  # type: ignore[misc]
    )
