"""Synthetic engines and requests for dry runs (CLI, benchmarks): fake addresses, no memory behind them."""

from __future__ import annotations

import numpy as np

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout.geometry import CacheOptions, RankGeometry
from hybrid_transfer.layout.model import LayerKind, ModelSpec
from hybrid_transfer.layout.tensor_map import build_tensor_map
from hybrid_transfer.plan.rank import RankDescriptor, describe_rank

_GAP = 1 << 32  # keeps fake regions far apart, so no range can run from one into the next


def fake_engine(model: ModelSpec, tp_size: int, options: CacheOptions | None, num_blocks: int,
                engine_index: int = 0) -> list[RankDescriptor]:
    """Descriptors of every rank of an engine whose tensors sit at distinct, widely spaced fake addresses."""
    geos = [RankGeometry(model, tp_size, r, options) for r in range(tp_size)]
    region = num_blocks * geos[0].page_bytes
    stride = (region // _GAP + 2) * _GAP
    rank_stride = stride * geos[0].num_tensors + _GAP
    base = _GAP + engine_index * (rank_stride * tp_size + _GAP)
    return [describe_rank(g, [base + r * rank_stride + j * stride for j in range(g.num_tensors)], num_blocks)
            for r, g in enumerate(geos)]


def blocks_needed(model: ModelSpec, block_size: int, num_tokens: int, draft_layers: int = 0) -> list[int]:
    """Block ids per cache group of a request: ceil(n / B) per attention group, one per GDN group."""
    kinds = [g.kind for g in build_tensor_map(model, draft_layers).groups]
    need = -(-num_tokens // block_size)
    return [need if k is LayerKind.ATTENTION else 1 for k in kinds]


def make_block_ids(counts: list[int], num_blocks: int, fragmentation: float,
                   rng: np.random.Generator) -> list[list[int]]:
    """Distinct ids per group: contiguous from 0, with a ``fragmentation`` share replaced by random free ids.

    fragmentation 0.0: ids 0, 1, 2, ... in group order; 1.0: every id random from the pool, in random order.
    """
    total = sum(counts)
    if num_blocks < total:
        raise ConfigError(f"num_blocks={num_blocks} cannot hold {total} blocks", field="num_blocks", value=num_blocks)
    if not 0.0 <= fragmentation <= 1.0:
        raise ConfigError(f"fragmentation={fragmentation} must be in [0, 1]", field="fragmentation",
                          value=fragmentation)
    ids = np.arange(total, dtype=np.int64)
    k = int(round(fragmentation * total))
    if k:
        positions = rng.choice(total, size=k, replace=False)
        keep = np.setdiff1d(ids, ids[positions])
        free = np.setdiff1d(np.arange(num_blocks, dtype=np.int64), keep)
        ids[positions] = rng.choice(free, size=k, replace=False)
    out, start = [], 0
    for c in counts:
        out.append(ids[start : start + c].tolist())
        start += c
    return out
