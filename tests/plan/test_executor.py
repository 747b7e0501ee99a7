"""The plain-memory executor moves exactly the bytes a plan names, direct or packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_transfer.errors import PlanError, RangeError
from hybrid_transfer.plan.executor import MemorySpace, execute
from hybrid_transfer.plan.stage_layout import StageLayout, map_rows
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode, ReadPlan, SourcePlan

I64 = np.int64


def spaces():
    src_buf = np.arange(256, dtype=np.uint8)
    dst_buf = np.zeros(64, dtype=np.uint8)
    src, dst = MemorySpace("src"), MemorySpace("dst")
    src.register(0x1000, src_buf)
    dst.register(0x9000, dst_buf)
    return src, dst, dst_buf


def plan_of(source) -> ReadPlan:
    return ReadPlan(0, PlanMode.COALESCED, (source,), (), 1, source.total_bytes)


ROWS = (np.array([0x9000, 0x9010, 0x9004], dtype=I64), np.array([0x1040, 0x1000, 0x10F0], dtype=I64),
        np.array([4, 8, 2], dtype=I64))


def expected():
    want = np.zeros(64, dtype=np.uint8)
    want[0:4] = np.arange(0x40, 0x44)
    want[16:24] = np.arange(0, 8)
    want[4:6] = np.arange(0xF0, 0xF2)
    return want


def test_direct_rows_copy_remote_bytes_to_local():
    src, dst, dst_buf = spaces()
    execute(plan_of(SourcePlan(0, *ROWS)), dst, {0: src})
    assert np.array_equal(dst_buf, expected())


def test_pack_rows_gather_read_and_scatter_the_same_bytes():
    """The source stages more than this rank reads (another rank's share sits between): two read ranges."""
    src, dst, dst_buf = spaces()
    addr = np.array([0x1000, 0x1080, 0x1040, 0x10F0], dtype=I64)  # staged in this order, 0x1080 not ours
    length = np.array([8, 16, 4, 2], dtype=I64)
    layout = StageLayout(addr, length, np.array([0, 8, 24, 28], dtype=I64))
    direct = SourcePlan(0, *ROWS)
    packed = PackSourcePlan(direct, layout, map_rows(layout, *ROWS))
    assert list(zip(packed.read.remote_offset.tolist(), packed.read.length.tolist(), strict=True)) == [(0, 8), (24, 6)]
    assert (packed.num_descriptors, packed.total_bytes, packed.staged_bytes) == (2, 14, 30)
    execute(plan_of(packed), dst, {0: src})
    assert np.array_equal(dst_buf, expected())


def test_ranges_outside_registered_memory_raise():
    src, dst, _ = spaces()
    bad = SourcePlan(0, np.array([0x9000 + 60], dtype=I64), np.array([0x1000], dtype=I64), np.array([8], dtype=I64))
    with pytest.raises(RangeError):
        execute(plan_of(bad), dst, {0: src})
    with pytest.raises(PlanError):
        execute(plan_of(SourcePlan(1, *ROWS)), dst, {0: src})


def test_torch_tensors_register_through_numpy_and_alias():
    t = torch.zeros(32, dtype=torch.uint8)
    space = MemorySpace()
    space.register(t.data_ptr(), t.numpy())
    space.view(t.data_ptr() + 4, 2)[:] = 7
    assert t[4:6].tolist() == [7, 7] and t.sum().item() == 14


def test_overlapping_registration_is_refused():
    space = MemorySpace()
    space.register(100, np.zeros(10, dtype=np.uint8))
    with pytest.raises(PlanError):
        space.register(105, np.zeros(10, dtype=np.uint8))
    with pytest.raises(PlanError):
        space.register(95, np.zeros(10, dtype=np.uint8))
    space.register(110, np.zeros(10, dtype=np.uint8))
