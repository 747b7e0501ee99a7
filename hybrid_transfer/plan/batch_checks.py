"""The planner's plan checks over every plan of a step at once (issue 20: vectorized checks).

A decode step plans many requests against one producer engine (docs/lifecycle.md#batched-reads).
``Planner.plan_many`` first tries the strict one-pass checks of plan/batch_rows.py; a step they do not
clear comes here: every plan's rows in one table, and a plan this pass flags is checked again alone by
``validate_plan``, so its typed error (and the value it names) is exactly the one ``Planner.plan`` raises,
and the other requests go on. (The ids of such a step are checked per request by ``validate_block_ids``.)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from hybrid_transfer.errors import PlanError
from hybrid_transfer.plan.types import PackSourcePlan, ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import RegionTable, validate_plan


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
