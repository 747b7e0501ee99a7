"""Per-source templates: everything about a read that does not depend on the request.

Built once per (consumer rank, producer engine). A template holds, for one
source rank, byte offsets relative to a page (state) or to a token segment
(KV); a request then only adds block-id arithmetic. Every topology falls out of
one rule: intersect what the consumer holds with what the source holds
(global KV heads, global conv channels per Q/K/V segment, global value heads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybrid_transfer.errors import TopologyError
from hybrid_transfer.layout.geometry import ConvLayout, RankGeometry

# Local offsets of a batched template carry the source index above this bit: one merge over every
# source then never joins two sources' pieces, and its sort leaves rows grouped by source.
# 2**48 bytes is far beyond any registered region.
SOURCE_SHIFT = 48
SOURCE_MASK = (1 << SOURCE_SHIFT) - 1

# Naive-mode sub-region keys of one state page: conv segment s, window row k -> s * _ROWS + k; ssm -> _SSM_KEY.
_ROWS = 1 << 16
_SSM_KEY = 3 * _ROWS


@dataclass(frozen=True)
class KVTemplate:
    """(half, head slot) pairs one source serves, as offsets inside a kernel block on each side.

    Row c reads head ``remote_slot[c]`` of half ``half[c]`` into local slot ``local_slot[c]``;
    ``local_const`` / ``remote_const`` are that half and slot's offset at token 0 of the kernel block.
    In the interleaved layout a head's token run holds K and V together, so there is one row per
    slot (half 0, standing for both halves); in split, a K row and a V row.
    """

    half: np.ndarray
    local_slot: np.ndarray
    remote_slot: np.ndarray
    local_const: np.ndarray
    remote_const: np.ndarray

    @property
    def is_empty(self) -> bool:
        return self.half.shape[0] == 0


@dataclass(frozen=True)
class StateTemplate:
    """Pieces of one GDN state page one source serves, as offsets from the start of the page."""

    local_off: np.ndarray
    remote_off: np.ndarray
    length: np.ndarray
    key: np.ndarray  # naive-mode sub-region (conv segment and window row, or ssm)

    @property
    def is_empty(self) -> bool:
        return self.length.shape[0] == 0


def assign_kv_heads(local: RankGeometry, sources: dict[int, RankGeometry]) -> dict[int, list[tuple[int, int]]]:
    """For each local head slot, the first candidate source holding that global head.

    Returns source rank -> [(local_slot, remote_slot)]. With fan-in and replicated
    prefill heads (K=2, P=4, D=1) only ranks 0 and 2 get slots.

    Raises:
        TopologyError: a local head no candidate source holds.
    """
    pairs: dict[int, list[tuple[int, int]]] = {s: [] for s in sources}
    for slot, head in enumerate(local.kv_heads):
        for rank in sorted(sources):
            src = sources[rank]
            if head in src.kv_heads:
                pairs[rank].append((slot, head - src.first_kv_head))
                break
        else:
            any_src = next(iter(sources.values()))
            raise TopologyError(f"no candidate source among {sorted(sources)} holds KV head {head}",
                                prefill_tp=any_src.tp_size, decode_tp=local.tp_size, head=head)
    return pairs


def kv_template(local: RankGeometry, source: RankGeometry, pairs: list[tuple[int, int]]) -> KVTemplate:
    """Offsets of each (half, slot) read inside a kernel block, K rows before V rows (one row per slot if interleaved).

    Both sides share one KV layout (the planner checks it), so one row shape fits both.
    """
    slots = np.array(pairs, dtype=np.int64).reshape(-1, 2)
    n = slots.shape[0]
    num_halves = 2 // local.kv_halves_per_run
    half = np.repeat(np.arange(num_halves, dtype=np.int64), n)
    local_slot = np.tile(slots[:, 0], num_halves)
    remote_slot = np.tile(slots[:, 1], num_halves)
    local_const = half * local.kv_half_stride + local_slot * local.kv_head_stride
    remote_const = half * source.kv_half_stride + remote_slot * source.kv_head_stride
    return KVTemplate(half, local_slot, remote_slot, local_const, remote_const)


def _intersect(a: range, b: range) -> tuple[int, int]:
    return max(a.start, b.start), min(a.stop, b.stop)


def state_template(local: RankGeometry, source: RankGeometry) -> StateTemplate:
    """Conv (per Q/K/V segment, per window row in SD) and ssm pieces of one state page from one source.

    DS: one piece per segment (the 3-read conv transfer when TP differs);
    SD: one piece per segment and window row. ssm: one piece for the shared value heads.
    """
    rows: list[tuple[int, int, int, int]] = []
    if local.has_gdn:
        isz = local.conv_itemsize
        w = local.conv_window
        for seg in range(3):
            lr, sr = local.conv_channel_ranges[seg], source.conv_channel_ranges[seg]
            lo, hi = _intersect(lr, sr)
            if lo >= hi:
                continue
            l_chan = local.conv_segment_channel_offsets[seg] + lo - lr.start
            r_chan = source.conv_segment_channel_offsets[seg] + lo - sr.start
            if local.conv_layout is ConvLayout.DS:
                rows.append((l_chan * w * isz, r_chan * w * isz, (hi - lo) * w * isz, seg * _ROWS))
            else:
                for k in range(w):
                    rows.append(((k * local.conv_dim_local + l_chan) * isz, (k * source.conv_dim_local + r_chan) * isz,
                                 (hi - lo) * isz, seg * _ROWS + k))
        lv, sv = local.value_heads, source.value_heads
        lo, hi = _intersect(lv, sv)
        if lo < hi:
            hb = local.ssm_head_bytes
            rows.append((local.conv_bytes + (lo - lv.start) * hb, source.conv_bytes + (lo - sv.start) * hb,
                         (hi - lo) * hb, _SSM_KEY))
    cols = np.array(rows, dtype=np.int64).reshape(-1, 4)
    return StateTemplate(*(np.ascontiguousarray(cols[:, i]) for i in range(4)))


@dataclass(frozen=True)
class SourceTemplate:
    source_rank: int
    geometry: RankGeometry
    kv: KVTemplate
    state: StateTemplate
    tensor_addrs: np.ndarray  # int64 base address of each shared tensor on the source
    device_id: int
    num_blocks: int


def stack_templates(templates: tuple[SourceTemplate, ...]) -> tuple[KVTemplate, StateTemplate]:
    """Every source's KV and state templates in one, local offsets tagged with the source's index."""
    def tag(values: np.ndarray, index: int) -> np.ndarray:
        return values + (index << SOURCE_SHIFT)

    kvs = [t.kv for t in templates]
    kv = KVTemplate(
        half=np.concatenate([k.half for k in kvs]),
        local_slot=np.concatenate([k.local_slot for k in kvs]),
        remote_slot=np.concatenate([k.remote_slot for k in kvs]),
        local_const=np.concatenate([tag(k.local_const, i) for i, k in enumerate(kvs)]),
        remote_const=np.concatenate([k.remote_const for k in kvs]),
    )
    sts = [t.state for t in templates]
    state = StateTemplate(
        local_off=np.concatenate([tag(x.local_off, i) for i, x in enumerate(sts)]),
        remote_off=np.concatenate([x.remote_off for x in sts]),
        length=np.concatenate([x.length for x in sts]),
        key=np.concatenate([x.key for x in sts]),
    )
    return kv, state
