"""Auto mode (docs/planner.md#auto): one mode per request shape, for every source of a plan, whatever the ids.

Issue 20: on the H200 auto flipped between rounds and mixed modes (P2->D8 8K: 0.12-0.31 of the ceiling,
mostly direct, where pack gives 0.31), because it chose per source from each request's own descriptor
count with each rank's own start-up calibration. Now the planner decides once per segment structure and
cost model, on the shape's fragmented direct plan.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_transfer.layout import load_preset
from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode

Q397 = "qwen3.5-397b-a17b"


def _modes(model, p: int, d: int, tokens: int, cost: CostModel, draws, rank: int = 0, pool: int = 256) -> list[tuple]:
    producers, consumers = fake_engine(model, p, None, pool, 0), fake_engine(model, d, None, pool, 1)
    planner = Planner(model, consumers[rank], producers, cost=cost)
    out = []
    for seed, fragmentation in draws:
        rng = np.random.default_rng(seed)
        local = make_block_ids(blocks_needed(model, consumers[0].block_size, tokens), pool, fragmentation, rng)
        remote = make_block_ids(blocks_needed(model, producers[0].block_size, tokens), pool, fragmentation, rng)
        plan = planner.plan(local, remote, tokens, PlanMode.AUTO)
        assert [isinstance(s, PackSourcePlan) for s in plan.sources] == [
            v == "pack" for v in plan.meta["source_modes"].values()]
        out.append(tuple(plan.meta["source_modes"].values()))
    return out


DRAWS = [(seed, frag) for seed in range(3) for frag in (0.0, 0.25, 0.5, 1.0)]


def test_one_shape_gets_one_mode_whatever_its_ids():
    """P1->D1, 8,192 tokens: 75 descriptors when the ids are contiguous, 120 when fragmented. With a cost
    model whose break-even lies between (10 us per descriptor, a 1 ms scatter launch), choosing per
    request packed the fragmented draws only; the shape now gets one mode for every draw."""
    cost = CostModel(per_descriptor_s=1e-5, per_byte_s=0.0, copy_per_byte_s=0.0, per_piece_copy_s=0.0,
                     copy_launch_s=1e-3)
    modes = _modes(load_preset(Q397), 1, 1, 8192, cost, DRAWS)
    assert len(set(modes)) == 1, modes


def test_a_plan_never_mixes_modes_across_its_sources():
    """P8->D2 reads one source's KV and state (465 fragmented descriptors) and three sources' state only
    (180 each). A model whose break-even lies between packed the first and read the others directly, so
    the request waited on both paths; now every source of a plan goes one way."""
    cost = CostModel(per_descriptor_s=1e-5, per_byte_s=0.0, copy_per_byte_s=0.0, per_piece_copy_s=0.0,
                     copy_launch_s=3e-3)
    for modes in _modes(load_preset(Q397), 8, 2, 8192, cost, DRAWS[:4]):
        assert len(modes) == 4 and len(set(modes)) == 1, modes


@pytest.mark.parametrize("rank", range(8))
def test_every_decode_rank_of_one_shape_chooses_alike(rank):
    """P2->D8, 8,192 tokens, the default (H200) model: every rank packs, for every id draw."""
    modes = _modes(load_preset(Q397), 2, 8, 8192, CostModel(), DRAWS, rank=rank)
    assert set(modes) == {("pack",)}, modes


@pytest.mark.parametrize(("preset", "tokens", "p", "d", "want"), [
    (Q397, 8192, 1, 1, "coalesced"),  # H200: direct 0.20-0.25 of the ceiling, pack 0.09-0.13
    (Q397, 8192, 2, 8, "pack"),  # H200: pack 0.30, direct 0.10
    (Q397, 131_072, 2, 8, "pack"),  # H200: pack 0.39-0.40, direct 0.12-0.13
    ("qwen3.5-0.8b", 2048, 1, 1, "coalesced"),
])
def test_the_gpu_model_chooses_the_mode_that_was_faster_on_the_h200(preset, tokens, p, d, want):
    """The default model (the H200 preset) against the one-H200 rows of docs/benchmarks.md#issue-13-final.

    Before pack's fixed share was in the model, P1->D1 was packed (0.46 ms estimated against 0.81 ms direct)
    though pack ran at half direct's speed there."""
    modes = _modes(load_preset(preset), p, d, tokens, CostModel(), [(0, 1.0), (1, 0.0)], pool=512)
    assert set(modes) == {(want,) * len(modes[0])}, modes


@pytest.mark.parametrize(("tokens", "p", "d"), [(8192, 1, 1), (8192, 2, 8), (131_072, 2, 8), (8192, 8, 2)])
def test_the_host_model_reads_directly(tokens, p, d):
    """On a CPU host the scatter is a second full copy through the same cores (docs/benchmarks.md): direct."""
    from hybrid_transfer.plan.cost import HOST_COST

    modes = _modes(load_preset(Q397), p, d, tokens, HOST_COST, [(0, 1.0)], pool=512)
    assert set(modes[0]) == {"coalesced"}, modes
