"""Page interiors (docs/attention-layouts.md#page-interiors): a kernel page whose interior is not token-major
moves whole, never split by token, and two sides of different interiors never plan a read.

The byte-level proof over every topology is test_planner_properties.py (it draws opaque interiors);
these pin the counts and the refusals.
"""

from __future__ import annotations

import numpy as np
import pytest

from hybrid_transfer.errors import ConfigError, FingerprintMismatch, TopologyError
from hybrid_transfer.layout import CacheOptions, RankGeometry, fingerprint_diff, fingerprint_of, load_preset
from hybrid_transfer.layout.geometry import TOKEN_MAJOR
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor, describe_rank, geometry_from_descriptor
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids

CPU = "CPU_ATTN:vec"


def model():
    return load_preset("qwen3.5-0.8b")


def opaque(block_size=1024, kernel=128, interior=CPU):
    return CacheOptions(block_size=block_size, kernel_block_size=kernel, kv_interior=interior)


def plan(m, prefill, decode, n, p=1, d=1, mode="coalesced"):
    producers = fake_engine(m, p, prefill, 64, 0)
    consumers = fake_engine(m, d, decode, 64, 1)
    rng = np.random.default_rng(0)
    remote = make_block_ids(blocks_needed(m, producers[0].block_size, n), producers[0].num_blocks, 1.0, rng)
    local = make_block_ids(blocks_needed(m, consumers[0].block_size, n), consumers[0].num_blocks, 1.0, rng)
    planner = Planner(m, consumers[0], producers)
    return planner, planner.plan(local, remote, n, mode)


@pytest.mark.parametrize("n", [1, 127, 128, 129, 255, 1023, 1024, 1100])
@pytest.mark.parametrize("mode", ["coalesced", "pack", "auto"])
def test_an_opaque_interior_moves_every_kernel_page_holding_a_token_whole(n, mode):
    m = model()
    planner, got = plan(m, opaque(), opaque(), n, mode=mode)
    g = planner.local
    per_token = g.kv_bytes_per_token * len(m.attention_layers)
    pages = -(-n // 128)
    assert got.expected_bytes == pages * 128 * per_token + g.state_bytes_per_request
    assert got.total_bytes == got.expected_bytes
    assert got.meta["valid_bytes"] == n * per_token + g.state_bytes_per_request


def test_a_token_major_interior_still_moves_valid_tokens_only():
    m = model()
    planner, got = plan(m, opaque(interior=TOKEN_MAJOR), opaque(interior=TOKEN_MAJOR), 129)
    assert got.expected_bytes == planner.expected_bytes(129)


def test_interiors_that_differ_are_refused_naming_both():
    m = model()
    with pytest.raises(FingerprintMismatch) as info:
        plan(m, opaque(interior="CPU_ATTN:amx"), opaque(interior=CPU), 10)
    assert ("kv_interior", CPU, "CPU_ATTN:amx") in list(info.value.differences)
    ours = fingerprint_of(RankGeometry(m, 1, 0, opaque(interior=CPU)))
    theirs = fingerprint_of(RankGeometry(m, 1, 0, opaque(interior=TOKEN_MAJOR)))
    assert fingerprint_diff(ours, theirs) == [("kv_interior", CPU, TOKEN_MAJOR)]


def test_an_opaque_interior_refuses_kernel_pages_of_another_size():
    m = model()
    with pytest.raises(TopologyError, match="kernel block sizes 128 .prefill. and 64 .decode. differ"):
        plan(m, opaque(kernel=128), opaque(kernel=64), 10)
    # Token-major pages re-block across kernel sizes as before.
    plan(m, opaque(kernel=128, interior=TOKEN_MAJOR), opaque(kernel=64, interior=TOKEN_MAJOR), 10)


@pytest.mark.parametrize("bad", ["", "x" * 65, "CPU\n", "ünï", 7])
def test_a_bad_interior_name_is_a_typed_error_naming_it(bad):
    with pytest.raises(ConfigError, match="kv_interior="):
        CacheOptions(kv_interior=bad)


def test_the_interior_travels_in_the_rank_descriptor():
    m = model()
    g = RankGeometry(m, 2, 1, opaque())
    desc = describe_rank(g, [4096 * (i + 1) for i in range(g.num_tensors)], 8)
    assert desc.kv_interior == CPU
    assert geometry_from_descriptor(m, desc).kv_interior == CPU
    older = RankDescriptor(**{f: getattr(desc, f) for f in RankDescriptor.__struct_fields__ if f != "kv_interior"})
    assert older.kv_interior == TOKEN_MAJOR  # a field added last with a default (wire version 9)

