"""The ceiling buffers' byte pattern: what the check accepts and what it catches."""

from __future__ import annotations

import pytest
import torch

from hybrid_transfer.bench.ceiling import _PERIOD, check_pattern, fill_pattern
from hybrid_transfer.errors import VerificationError
from hybrid_transfer.verify import POISON_BYTE

N = 2 * _PERIOD + 12345  # crosses period boundaries


@pytest.fixture(scope="module")
def filled() -> torch.Tensor:
    buf = torch.empty(N, dtype=torch.uint8)
    fill_pattern(buf, seed=7)
    return buf


def test_no_pattern_byte_is_the_poison_byte(filled):
    assert not bool((filled == POISON_BYTE).any())


@pytest.mark.parametrize("start, stop", [(0, N), (5, 1000), (_PERIOD - 3, _PERIOD + 3), (_PERIOD + 1, N)])
def test_any_segment_passes_at_its_own_offset(filled, start, stop):
    check_pattern(filled[start:stop].clone(), 7, start, "segment")


@pytest.mark.parametrize("case", ["shifted", "other seed", "one byte", "poisoned"])
def test_check_catches_wrong_bytes(filled, case):
    seg, offset, seed = filled[1000:50000].clone(), 1000, 7
    if case == "shifted":
        offset += 1
    elif case == "other seed":
        seed = 8
    elif case == "one byte":
        seg[4321] ^= 0x10
    else:
        seg[20000:20100] = POISON_BYTE
    with pytest.raises(VerificationError):
        check_pattern(seg, seed, offset, case)
