"""The copier's one kernel per step (engine/mapped/cuda_ipc.py) on one GPU: the table read in place from
pinned host memory and the uploaded table move exactly the ranges asked, and nothing else."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_transfer.engine.mapped.cuda_ipc import RangeCopier


def _ranges(rng, buf_bytes, n):
    """n disjoint ranges of random sizes (multiples of 4 bytes, some over a chunk) at random places."""
    sizes = rng.integers(1, 600_000, n) * 4
    slots = np.sort(rng.choice(buf_bytes // (4 << 20), n, replace=False)) * (4 << 20)
    return slots.astype(np.int64), sizes.astype(np.int64)


def test_the_probe_picks_a_table_path_that_moves_right_bytes():
    copier = RangeCopier("cuda")
    print(f"table read in place: {copier.table_in_place}")  # the figure the note reports (-s)
    assert isinstance(copier.table_in_place, bool)


@pytest.mark.parametrize("in_place", [True, False])
def test_both_table_paths_move_exactly_the_ranges(in_place):
    rng = np.random.default_rng(5)
    buf = 1 << 30
    src = torch.randint(0, 255, (buf,), dtype=torch.uint8, device="cuda")
    dst = torch.zeros(buf, dtype=torch.uint8, device="cuda")
    copier = RangeCopier("cuda", table_in_place=in_place)
    if in_place and not RangeCopier("cuda").table_in_place:
        pytest.fail("the probe refused a table in pinned host memory on this GPU: say so in the note")
    src_off, lengths = _ranges(rng, buf, 200)
    dst_off = rng.permutation(src_off)
    for _ in range(3):  # slots are reused once their copy is done
        event = copier.copy(dst.data_ptr() + dst_off, src.data_ptr() + src_off, lengths)
        event.synchronize()
    expected = torch.zeros_like(dst)
    for d, s_, n in zip(dst_off.tolist(), src_off.tolist(), lengths.tolist(), strict=True):
        expected[d:d + n] = src[s_:s_ + n]
    assert torch.equal(dst, expected)
