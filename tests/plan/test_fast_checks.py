"""The planner's one-pass checks (plan/batch_rows.py: ``IdCheck``, ``rows_fine``) against the exact ones.

``Planner.plan`` and ``plan_many`` only run ``validate_block_ids`` / ``validate_plan`` when a cheap strict
check over the whole step does not clear it. Here a reference runs the exact checks on every request, in
``plan``'s order, and both planner calls must give the same plan or the same typed error: over requests
with bad ids of many kinds (and inputs of every accepted type), and over plans whose rows a corrupted
recipe pushes out of their regions or onto each other (the planner bug ``validate_plan`` is there for: the
planner checks a shape's pieces once, batch_rows.Fit, and no request's rows).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_batch_plan import step
from test_recipe_tail import assert_same

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout import KVLayout
from hybrid_transfer.plan import planner as planner_module
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.templates import SOURCE_SHIFT
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.plan.validate import block_id_arrays, validate_block_ids, validate_plan

TOPOLOGIES = [("qwen3.5-397b-a17b", 1, 1), ("qwen3.5-397b-a17b", 2, 8), ("qwen3.5-27b", 4, 1),
              ("qwen3.5-0.8b", 1, 2)]
POOL = 256
DEFECTS = ["none", "none", "tuples", "arrays", "numpy_ints", "bools", "huge", "remote_far_negative",
           "local_far", "local_extra_dup", "cross_group_dup", "short_local", "long_remote", "gdn_two",
           "float_ids", "first_token_bad", "zero_tokens", "local_range", "remote_range"]


def _corrupt(defect: str, local, remote, n: int, rng: np.random.Generator):
    local, remote, first = [list(g) for g in local], [list(g) for g in remote], 0
    if defect == "tuples":
        local, remote = tuple(tuple(g) for g in local), tuple(tuple(g) for g in remote)
    elif defect == "arrays":
        local, remote = [np.asarray(g, dtype=np.int64) for g in local], [np.asarray(g, dtype=np.int64) for g in remote]
    elif defect == "numpy_ints":
        remote[0] = [np.int32(b) for b in remote[0]]
    elif defect == "bools":
        remote[-1] = [True] * len(remote[-1])
    elif defect == "huge":
        remote[0][0] = 2**63 + 5
    elif defect == "remote_far_negative":
        remote[0][0] = -(1 << 40)
    elif defect == "local_far":
        local[0][-1] = 1 << 40
    elif defect == "local_extra_dup":  # a duplicate among blocks the request does not use: still refused
        local[0] = local[0] + [local[-1][0]]
    elif defect == "cross_group_dup":
        local[-1][0] = local[0][0]
    elif defect == "short_local":
        local[0] = local[0][:-1]
    elif defect == "long_remote":
        remote[0] = remote[0] + [int(rng.integers(POOL))]
    elif defect == "gdn_two":
        local[-1] = local[-1] + local[-1]
    elif defect == "float_ids":
        remote[0] = [float(b) for b in remote[0]]
    elif defect == "first_token_bad":
        first = 1
    elif defect == "zero_tokens":
        n = 0
        local = [g[:0] if i == 0 else g for i, g in enumerate(local)]
        remote = [g[:0] if i == 0 else g for i, g in enumerate(remote)]
    elif defect == "local_range":
        local[-1][0] = POOL
    elif defect == "remote_range":
        remote[0][-1] = POOL + 1
    return local, remote, n, first


def _reference(planner: Planner, local, remote, n, mode, first):
    """``plan`` with every exact check run, in its order (no one-pass shortcut decides anything)."""
    try:
        if not isinstance(n, int) or n < 0:
            raise PlanError(f"num_tokens={n!r} must be a non-negative integer", num_tokens=n)
        first = planner._first_token(first, n, mode)
        groups = len(planner._kinds)
        lo, ro = block_id_arrays("local", local, groups), block_id_arrays("remote", remote, groups)
        validate_block_ids("local", lo, planner._kinds, n, planner.local.block_size, planner.local_desc.num_blocks,
                           exact=False)
        validate_block_ids("remote", ro, planner._kinds, n, planner.remote.block_size, planner._remote_num_blocks,
                           exact=True)
        plan = planner.plan(lo, ro, n, mode, validate=False, first_token=first)
        validate_plan(plan, planner._local_regions, planner._remote_regions)
        return plan
    except PlanError as exc:
        return exc


def _outcome(planner: Planner, local, remote, n, mode, first):
    try:
        return planner.plan(local, remote, n, mode, first_token=first)
    except PlanError as exc:
        return exc


def _assert_same_outcome(got, want, label: str) -> None:
    if isinstance(want, PlanError):
        assert type(got) is type(want) and str(got) == str(want), (label, got, want)
    else:
        assert not isinstance(got, PlanError), (label, got)
        assert_same(got, want, label)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(TOPOLOGIES), layout=st.sampled_from(list(KVLayout)),
       mode=st.sampled_from([PlanMode.COALESCED, PlanMode.NAIVE, PlanMode.AUTO]),
       requests=st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([0.0, 1.0]), st.sampled_from(DEFECTS)),
                         min_size=1, max_size=6),
       seed=st.integers(0, 2**16))
def test_plan_and_plan_many_refuse_what_the_exact_checks_refuse(topology, layout, mode, requests, seed):
    model, consumer, producers, clean = step(topology, layout, [(n, f) for n, f, _ in requests], seed, POOL)
    rng = np.random.default_rng(seed)
    items = [_corrupt(defect, *item, rng) for (_, _, defect), item in zip(requests, clean, strict=True)]
    many = Planner(model, consumer, producers).plan_many(items, mode)
    planner = Planner(model, consumer, producers)
    for (local, remote, n, first), (_, _, defect), out in zip(items, requests, many, strict=True):
        want = _reference(Planner(model, consumer, producers), local, remote, n, mode, first)
        _assert_same_outcome(_outcome(planner, local, remote, n, mode, first), want, f"plan ({defect})")
        _assert_same_outcome(out, want, f"plan_many ({defect})")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(topology=st.sampled_from(TOPOLOGIES), layout=st.sampled_from(list(KVLayout)),
       requests=st.lists(st.tuples(st.integers(1, 5000), st.sampled_from([0.0, 1.0])), min_size=2, max_size=5),
       side=st.sampled_from(["local_const", "remote_const", "length"]),
       delta=st.sampled_from([-1, 1, -(1 << 20), 1 << 30, 1 << 44]), which=st.integers(0, 2**16),
       seed=st.integers(0, 2**16))
def test_a_corrupted_recipe_gets_the_exact_checks_error(topology, layout, requests, side, delta, which, seed):
    """A recipe piece moved or grown by ``delta`` bytes (a planner bug): its rows may leave their region,
    overlap another row, move the wrong bytes, or stay fine; plan and plan_many must say what
    ``validate_plan`` says of the same rows (the shape's Fit is found on the corrupted recipe)."""
    model, consumer, producers, items = step(topology, layout, requests, seed, POOL)

    def corrupted(*args, **kwargs):
        rec = real(*args, **kwargs)
        column = getattr(rec, side).copy()
        # A tail piece's length is each token end's (Recipe.with_tail): a wrong one is not a recipe's to keep.
        pick = np.setdiff1d(np.arange(column.shape[0]), rec.tail) if side == "length" else np.arange(column.shape[0])
        if pick.shape[0]:
            i = pick[which % pick.shape[0]]
            # A local offset carries its source's tag above SOURCE_SHIFT: a move that borrows from it is another
            # source's piece, where the batch's sort key (tagged by request) and a lone request's differ.
            if side == "length" or (int(column[i]) + delta) >> SOURCE_SHIFT == int(column[i]) >> SOURCE_SHIFT:
                column[i] += delta
        return dataclasses.replace(rec, **{side: column})

    real = planner_module.recipe
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(planner_module, "recipe", corrupted)
        many = Planner(model, consumer, producers).plan_many(items, PlanMode.COALESCED)
        planner = Planner(model, consumer, producers)
        for i, (local, remote, n) in enumerate(items):
            plan = Planner(model, consumer, producers).plan(local, remote, n, PlanMode.COALESCED, validate=False)
            try:
                validate_plan(plan, planner._local_regions, planner._remote_regions)
                want: object = plan
            except PlanError as exc:
                want = exc
            _assert_same_outcome(_outcome(planner, local, remote, n, PlanMode.COALESCED, 0), want, f"plan {i}")
            _assert_same_outcome(many[i], want, f"plan_many {i}")


def test_a_step_too_large_to_tag_by_request_sorts_on_pairs_and_gets_the_same_plans():
    """Past ``Broadcast.max_tagged`` requests (or local regions reaching the tag's bits) the step's sort runs on
    (request, offset) pairs: the same plans as the tagged sort."""
    model, consumer, producers, items = step(TOPOLOGIES[1], KVLayout.INTERLEAVED, [(3000, 1.0), (1, 0.0), (4096, 0.5)],
                                             7, POOL)
    tagged = Planner(model, consumer, producers)
    paired = Planner(model, consumer, producers)
    paired._broadcast = dataclasses.replace(paired._broadcast, local_region=1 << 48)
    assert paired._broadcast.max_tagged == 0 < tagged._broadcast.max_tagged
    for got, want in zip(paired.plan_many(items, PlanMode.COALESCED), tagged.plan_many(items, PlanMode.COALESCED),
                         strict=True):
        assert_same(got, want, "pairs")
