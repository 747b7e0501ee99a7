"""The planner's checks over every request of a step at once (issue 20: vectorized id checks).

A decode step plans many requests against one producer engine (docs/lifecycle.md#batched-reads). The
checks ``Planner.plan`` runs per request (``validate_block_ids`` on both sides, ``validate_plan`` on the
result) cost a handful of small numpy calls each; here each runs once over the whole step: the ids of
every request in one array, tagged by request, and every plan's rows in one table. The vectorized pass
only detects; a request it flags is checked again alone by the per-request function, so its typed error
(and the value it names) is exactly the one ``Planner.plan`` raises, and the other requests go on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.plan.types import PackSourcePlan, ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import RegionTable, validate_block_ids, validate_plan


def flag_bad_ids(flats: Sequence[np.ndarray], counts: np.ndarray, need: np.ndarray, kinds: Sequence[LayerKind],
                 num_blocks: int, *, exact: bool) -> np.ndarray:
    """A bool per request: its ids break a rule of ``validate_block_ids`` (count, range or uniqueness).

    Args:
        flats: each request's ids, groups concatenated.
        counts: [request, group] ids listed per group.
        need: attention blocks each request's token count needs.
    """
    gdn = np.fromiter((k is LayerKind.GDN for k in kinds), bool, len(kinds))
    attn = counts[:, ~gdn]
    short = (attn != need[:, None]) if exact else (attn < need[:, None])
    bad = short.any(axis=1) | (counts[:, gdn] != 1).any(axis=1)
    sizes = np.fromiter((f.shape[0] for f in flats), np.int64, len(flats))
    if not sizes.any():
        return bad
    ids = np.concatenate(flats)
    owner = np.repeat(np.arange(len(flats), dtype=np.int64), sizes)
    out = (ids < 0) | (ids >= num_blocks)
    bad[owner[out]] = True
    # Unique within a request: sort (request, id) pairs and look at neighbours.
    key = owner * (num_blocks + 1) + np.clip(ids, -1, num_blocks)
    key.sort()
    dup = (key[1:] == key[:-1]).nonzero()[0]
    bad[key[dup] // (num_blocks + 1)] = True
    return bad


def check_ids(side: str, ids: Sequence[Sequence[np.ndarray]], flats: Sequence[np.ndarray],
              num_tokens: Sequence[int], kinds: Sequence[LayerKind], block_size: int, num_blocks: int, *,
              exact: bool) -> list[PlanError | None]:
    """``validate_block_ids`` for every request: its error, or None."""
    counts = np.array([[a.shape[0] for a in req] for req in ids], dtype=np.int64).reshape(len(ids), len(kinds))
    need = -(-np.asarray(num_tokens, dtype=np.int64) // block_size)
    flagged = flag_bad_ids(flats, counts, need, kinds, num_blocks, exact=exact)
    errors: list[PlanError | None] = [None] * len(ids)
    for i in flagged.nonzero()[0].tolist():
        try:
            validate_block_ids(side, ids[i], kinds, num_tokens[i], block_size, num_blocks, exact=exact,
                               flat=flats[i])
        except PlanError as exc:
            errors[i] = exc
    return errors


def check_plans(plans: Sequence[ReadPlan], local: RegionTable,
                remotes: Mapping[int, RegionTable]) -> list[PlanError | None]:
    """``validate_plan`` for every plan: its error, or None (rows of every plan checked in one table)."""
    errors: list[PlanError | None] = [None] * len(plans)
    rows: list[tuple[int, int, SourcePlan]] = []  # (request, source rank, direct rows)
    for i, plan in enumerate(plans):
        for src in plan.sources:
            direct = src.direct if isinstance(src, PackSourcePlan) else src
            if not isinstance(direct, SourcePlan) or src.source_rank not in remotes:
                errors[i] = _alone(plan, local, remotes)
                break
            rows.append((i, src.source_rank, direct))
    rows = [r for r in rows if errors[r[0]] is None]
    flagged = np.zeros(len(plans), dtype=bool)
    total = np.zeros(len(plans), dtype=np.int64)
    if rows:
        sizes = np.fromiter((r[2].length.shape[0] for r in rows), np.int64, len(rows))
        req = np.repeat(np.fromiter((r[0] for r in rows), np.int64, len(rows)), sizes)
        addr = np.concatenate([r[2].local_addr for r in rows])
        length = np.concatenate([r[2].length for r in rows])
        flagged[req[~local.contains(addr, length)]] = True
        for rank in {r[1] for r in rows}:
            mine = [r for r in rows if r[1] == rank]
            req_r = np.repeat(np.fromiter((r[0] for r in mine), np.int64, len(mine)),
                              [r[2].length.shape[0] for r in mine])
            remote = np.concatenate([r[2].remote_addr for r in mine])
            ln = np.concatenate([r[2].length for r in mine])
            flagged[req_r[~remotes[rank].contains(remote, ln)]] = True
        # No two destination ranges of one request overlap: sort by (request, address), compare neighbours.
        order = np.lexsort((addr, req))
        r_s, a_s, l_s = req[order], addr[order], length[order]
        clash = (r_s[1:] == r_s[:-1]) & (a_s[1:] < a_s[:-1] + l_s[:-1])
        flagged[r_s[1:][clash]] = True
        total = np.bincount(req, weights=length, minlength=len(plans)).astype(np.int64)
    expected = np.fromiter((p.expected_bytes for p in plans), np.int64, len(plans))
    flagged |= total != expected
    for i in flagged.nonzero()[0].tolist():
        if errors[i] is None:
            errors[i] = _alone(plans[i], local, remotes)
    return errors


def _alone(plan: ReadPlan, local: RegionTable, remotes: Mapping[int, RegionTable]) -> PlanError | None:
    try:
        validate_plan(plan, local, remotes)
    except PlanError as exc:
        return exc
    return None
