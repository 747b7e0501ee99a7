"""Synthetic engines and block ids for dry runs."""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_transfer.layout import load_preset
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids


def test_fake_regions_never_overlap_across_ranks_and_engines():
    model = load_preset("qwen3.5-397b-a17b")
    ranges = []
    for engine, tp in ((0, 2), (1, 8)):
        for desc in fake_engine(model, tp, None, 100, engine):
            assert desc.tp_size == tp and len(desc.tensor_addrs) == 15
            ranges += [(a, a + desc.region_bytes) for a in desc.tensor_addrs]
    ranges.sort()
    assert all(end <= nxt for (_, end), (nxt, _) in zip(ranges, ranges[1:], strict=False))


def test_blocks_needed_per_group():
    model = load_preset("qwen3.5-397b-a17b")
    assert blocks_needed(model, 528, 8192) == [16, 1, 1, 1]
    assert blocks_needed(model, 2096, 0) == [0, 1, 1, 1]


@pytest.mark.parametrize("fragmentation", [0.0, 0.3, 1.0])
def test_block_ids_are_distinct_and_in_range(fragmentation):
    ids = make_block_ids([16, 1, 1, 1], 80, fragmentation, np.random.default_rng(1))
    flat = [b for g in ids for b in g]
    assert [len(g) for g in ids] == [16, 1, 1, 1]
    assert len(set(flat)) == 19 and all(0 <= b < 80 for b in flat)
    if fragmentation == 0.0:
        assert flat == list(range(19))
    if fragmentation == 1.0:
        assert flat != list(range(19))


def test_bad_pool_or_fragmentation_is_a_config_error():
    from hybrid_transfer.errors import ConfigError

    with pytest.raises(ConfigError):
        make_block_ids([16, 1], 10, 0.0, np.random.default_rng(0))
    with pytest.raises(ConfigError):
        make_block_ids([1], 10, -0.1, np.random.default_rng(0))
