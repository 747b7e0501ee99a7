"""StagingPool: bounded, first-fit, aligned slices; freed neighbours merge; misuse is refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.engine.pack.staging import ALIGN_BYTES, StagingPool
from hybrid_transfer.errors import ConfigError, PlanError


def test_a_full_pool_says_so_and_frees_merge_back_into_one_run():
    pool = StagingPool(4 * ALIGN_BYTES)
    a, b, c = (pool.try_alloc(ALIGN_BYTES) for _ in range(3))
    assert pool.try_alloc(2 * ALIGN_BYTES) is None  # one aligned run is left
    d = pool.try_alloc(1)
    assert d is not None and d.tensor.numel() == 1 and pool.try_alloc(1) is None
    for piece in (b, d, a, c):
        pool.free(piece)
    assert pool.bytes_in_use == 0 and pool.num_slices == 0
    whole = pool.try_alloc(4 * ALIGN_BYTES)
    assert whole is not None and whole.addr == pool.region.addr and whole.tensor.numel() == 4 * ALIGN_BYTES
    with pytest.raises(PlanError):
        pool.free(a)  # a double free
    with pytest.raises(PlanError):
        pool.try_alloc(0)
    with pytest.raises(ConfigError):
        StagingPool(0)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.integers(1, 3000)), max_size=40))
def test_live_slices_never_overlap_and_stay_inside_the_pool(ops):
    pool = StagingPool(16 * ALIGN_BYTES)
    live = []
    for alloc, size in ops:
        if alloc or not live:
            piece = pool.try_alloc(size)
            if piece is None:
                assert pool.capacity_bytes - pool.bytes_in_use < -(-size // ALIGN_BYTES) * ALIGN_BYTES or live
                continue
            assert piece.offset % ALIGN_BYTES == 0 and piece.offset + size <= pool.capacity_bytes
            live.append(piece)
        else:
            pool.free(live.pop(size % len(live)))
        spans = sorted((p.offset, p.offset + p.nbytes) for p in live)
        assert all(e <= s for (_, e), (s, _) in zip(spans, spans[1:], strict=False))
    for piece in live:
        pool.free(piece)
    assert pool.try_alloc(pool.capacity_bytes) is not None
