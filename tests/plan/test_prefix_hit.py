"""Prefix hits (docs/planner.md#prefix-hits): a decode rank that already holds [0, F) reads [F, n) and the state.

The byte-level proof over every topology, layout and interior is test_planner_properties.py; these pin the
counts against a full read and the refusals.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout import CacheOptions, load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode


def _planner(prefill_block=1024, decode_block=1024, p=1, d=1, n=3000):
    m = load_preset("qwen3.5-0.8b")
    producers = fake_engine(m, p, CacheOptions(block_size=prefill_block, kernel_block_size=16), 64, 0)
    consumers = fake_engine(m, d, CacheOptions(block_size=decode_block, kernel_block_size=16), 64, 1)
    rng = np.random.default_rng(0)
    remote = make_block_ids(blocks_needed(m, producers[0].block_size, n), producers[0].num_blocks, 1.0, rng)
    local = make_block_ids(blocks_needed(m, consumers[0].block_size, n), consumers[0].num_blocks, 1.0, rng)
    return Planner(m, consumers[0], producers), local, remote


@pytest.mark.parametrize(("prefill_block", "decode_block"), [(1024, 1024), (2048, 1024), (1024, 2048), (1536, 1024)])
@pytest.mark.parametrize("mode", [PlanMode.COALESCED, PlanMode.PACK, PlanMode.AUTO])
def test_a_hit_saves_exactly_its_tokens_and_a_full_hit_moves_the_state_alone(prefill_block, decode_block, mode):
    n = 5000
    planner, local, remote = _planner(prefill_block, decode_block, n=n)
    per_token = planner.local.kv_bytes_per_token * len(planner.model.attention_layers)
    state = planner.local.state_bytes_per_request
    full = planner.plan(local, remote, n, mode)
    assert full.expected_bytes == n * per_token + state
    for first in range(decode_block, n + 1, decode_block):  # every local boundary, a full hit among them
        hit = planner.plan(local, remote, n, mode, first_token=first)
        assert hit.total_bytes == hit.expected_bytes == full.expected_bytes - first * per_token
        assert hit.meta["first_token"] == first
        assert not any(isinstance(src, PackSourcePlan) for src in hit.sources)  # direct past token 0
    whole, local, remote = _planner(prefill_block, decode_block, n=4096)  # a full hit: the state alone moves
    assert whole.plan(local, remote, 4096, mode, first_token=4096).total_bytes == state


def test_plan_many_takes_a_hit_per_request():
    planner, local, remote = _planner(n=3000)
    per_token = planner.local.kv_bytes_per_token * len(planner.model.attention_layers)
    plans = planner.plan_many([(local, remote, 3000), (local, remote, 3000, 2048), (local, remote, 3000, 1)])
    assert plans[0].total_bytes - plans[1].total_bytes == 2048 * per_token
    assert isinstance(plans[2], PlanError) and "first_token=1" in str(plans[2])


def test_a_hit_off_a_local_block_boundary_past_the_request_or_in_naive_mode_is_refused_by_value():
    planner, local, remote = _planner(n=3000)
    for first, mode, words in ((1, PlanMode.COALESCED, "not on a local block boundary"),
                               (3072, PlanMode.COALESCED, "past the request's 3000 tokens"),
                               (1024, PlanMode.NAIVE, "naive"),
                               (-1024, PlanMode.COALESCED, "non-negative"),
                               (True, PlanMode.COALESCED, "non-negative")):
        with pytest.raises(PlanError, match=words) as info:
            planner.plan(local, remote, 3000, mode, first_token=first)
        assert str(first) in str(info.value)
