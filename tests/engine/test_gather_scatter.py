"""Gather and scatter through one arena: every byte against a numpy slice oracle; bad pieces refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.engine.gather_scatter import Arena, Copier
from hybrid_transfer.errors import PlanError, RangeError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _tensors(rng: np.random.Generator, sizes, device="cpu") -> list[torch.Tensor]:
    return [torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8)).to(device) for n in sizes]


def _pieces(rng: np.random.Generator, tensors, unit: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Disjoint pieces in random order: each tensor cut at random multiples of ``unit``, a random subset kept."""
    addr, length = [], []
    for t in tensors:
        n = t.numel() // unit
        cuts = np.unique(np.concatenate(([0, n], rng.integers(0, n + 1, count))))
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            if rng.random() < 0.7:
                addr.append(t.data_ptr() + int(a) * unit)
                length.append(int(b - a) * unit)
    order = rng.permutation(len(addr))
    return np.array(addr, dtype=np.int64)[order], np.array(length, dtype=np.int64)[order]


def _bytes(tensors, addr: int, n: int) -> np.ndarray:
    for t in tensors:
        off = addr - t.data_ptr()
        if 0 <= off <= t.numel() - n:
            return t[off : off + n].cpu().numpy()
    raise AssertionError(f"{n} B at {addr:#x}")


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), unit=st.sampled_from([1, 3, 8, 512]), count=st.integers(1, 12))
def test_gather_then_scatter_moves_exactly_the_pieces(device, seed, unit, count):
    rng = np.random.default_rng(seed)
    src = _tensors(rng, [unit * int(rng.integers(1, 64)) for _ in range(3)], device)
    addr, length = _pieces(rng, src, unit, count)
    total = int(length.sum())
    staging = torch.zeros(total + 64, dtype=torch.uint8, device=device)
    ticket = Copier(Arena(src)).gather(addr, length, staging)
    ticket.wait()
    want = np.concatenate([_bytes(src, a, n) for a, n in zip(addr.tolist(), length.tolist(), strict=True)]
                          or [np.empty(0, np.uint8)])
    assert np.array_equal(staging[:total].cpu().numpy(), want)
    assert ticket.is_done and ticket.elapsed_s >= 0
    # Scatter the staged bytes into zeroed copies of the same tensors at the same places: only those change.
    dst = [torch.zeros_like(t) for t in src]
    moved = addr - np.array([t.data_ptr() for t in src])[[_index(src, a) for a in addr.tolist()]] + \
        np.array([d.data_ptr() for d in dst])[[_index(src, a) for a in addr.tolist()]]
    Copier(Arena(dst)).scatter(staging, moved, length).wait()
    for s_t, d_t in zip(src, dst, strict=True):
        mask = torch.zeros(s_t.numel(), dtype=torch.bool, device=device)
        for a, n in zip(addr.tolist(), length.tolist(), strict=True):
            off = a - s_t.data_ptr()
            if 0 <= off < s_t.numel():
                mask[off : off + n] = True
        assert torch.equal(d_t[mask], s_t[mask]) and not d_t[~mask].any()


def _index(tensors, addr: int) -> int:
    return next(i for i, t in enumerate(tensors) if 0 <= addr - t.data_ptr() < t.numel())


def test_pieces_outside_the_tensors_and_oversized_lists_are_refused():
    rng = np.random.default_rng(0)
    a, b = _tensors(rng, [4096, 4096])
    copier = Copier(Arena([a, b]))
    staging = torch.zeros(8192, dtype=torch.uint8)
    lo, hi = sorted((a, b), key=lambda t: t.data_ptr())
    with pytest.raises(RangeError):  # runs off the end of the lower tensor into the gap
        copier.gather(np.array([lo.data_ptr() + 4000]), np.array([200]), staging)
    with pytest.raises(RangeError):
        copier.scatter(staging, np.array([hi.data_ptr() + 4096]), np.array([1]))
    with pytest.raises(RangeError):
        copier.gather(np.array([lo.data_ptr() - 16]), np.array([16]), staging)
    with pytest.raises(PlanError, match="exceed"):
        copier.gather(np.array([lo.data_ptr()]), np.array([4096]), staging[:100])
    with pytest.raises(PlanError, match="flat uint8"):
        copier.gather(np.array([lo.data_ptr()]), np.array([16]), staging.view(torch.int32))
    assert not staging.any()  # nothing moved before a refusal
