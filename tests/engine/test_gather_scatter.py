"""Gather and scatter through one arena: every byte against a numpy slice oracle; bad pieces refused."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.engine.pack import gather_scatter
from hybrid_transfer.engine.pack.gather_scatter import Arena, Copier, IndexCache
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


def test_index_cache_maps_rows_to_pieces_once_per_shape_and_forgets_the_oldest():
    cache = IndexCache(torch.device("cpu"), capacity=2)
    rows_per = np.array([3, 1, 2], dtype=np.int64)
    piece, within = cache.shape(256, rows_per, 6)
    assert piece.tolist() == [0, 0, 0, 1, 2, 2] and within.tolist() == [0, 1, 2, 0, 0, 1]
    assert cache.shape(256, rows_per.copy(), 6)[0] is piece and (cache.hits, cache.misses) == (1, 1)
    assert cache.shape(128, rows_per, 6)[0] is not piece  # another row width is another shape
    cache.shape(256, np.array([2], dtype=np.int64), 2)  # a third shape: the least recently used goes
    assert len(cache) == 2
    assert cache.shape(256, rows_per, 6)[0] is not piece and cache.misses == 4


@settings(max_examples=30, deadline=None)
@given(rows_per=st.lists(st.integers(1, 40), min_size=1, max_size=30), seed=st.integers(0, 2**32 - 1))
def test_the_cached_shape_and_first_rows_make_the_row_index_the_device_path_uses(rows_per, seed):
    """first_row[piece(k)] + within[k] (the CUDA path's two kernels) is the row index, checked on CPU."""
    rows_per = np.array(rows_per, dtype=np.int64)
    first_row = np.random.default_rng(seed).integers(0, 10**6, rows_per.shape[0])
    piece, within = IndexCache(torch.device("cpu")).shape(64, rows_per, int(rows_per.sum()))
    index = torch.from_numpy(first_row).index_select(0, piece)
    index.add_(within)
    want = np.concatenate([np.arange(f, f + n) for f, n in zip(first_row.tolist(), rows_per.tolist(), strict=True)])
    assert index.dtype == torch.int64 and index.tolist() == want.tolist()


def _shifted_requests(device: str):
    """Two requests of one plan shape (same piece lengths, in the same order) at different places."""
    rng = np.random.default_rng(5)
    cache = _tensors(rng, [512 * 64, 512 * 48], device)
    lengths = np.array([512, 1536, 1024, 512], dtype=np.int64)
    requests = []
    for starts in ((0, 2, 10, 40), (5, 30, 20, 1)):  # 512-byte rows of the first tensor / of the second
        base = [cache[0].data_ptr(), cache[0].data_ptr(), cache[1].data_ptr(), cache[1].data_ptr()]
        requests.append(np.array([b + 512 * s for b, s in zip(base, starts, strict=True)], dtype=np.int64))
    return cache, requests, lengths


@pytest.mark.parametrize("device", DEVICES)
def test_requests_of_one_shape_reuse_the_index_map_and_land_bitwise(device):
    cache, requests, lengths = _shifted_requests(device)
    copier = Copier(Arena(cache))
    total = int(lengths.sum())
    for k, dst in enumerate(requests):
        staging = torch.arange(total, dtype=torch.int64, device=device).mul_(7 + k).to(torch.uint8)
        before = [t.clone() for t in cache]
        ticket = copier.scatter(staging, dst, lengths)
        deadline = time.monotonic() + 30
        while not ticket.is_done:  # completion seen by polling the end event (CUDA), at once on CPU
            assert time.monotonic() < deadline, "scatter not done in time"
        want = [t.cpu().numpy().copy() for t in before]
        off = 0
        for a, n in zip(dst.tolist(), lengths.tolist(), strict=True):
            i = _index(cache, a)
            o = a - cache[i].data_ptr()
            want[i][o : o + n] = staging[off : off + n].cpu().numpy()
            off += n
        assert all(np.array_equal(t.cpu().numpy(), w) for t, w in zip(cache, want, strict=True))
        back = torch.zeros(total, dtype=torch.uint8, device=device)
        copier.gather(dst, lengths, back).wait()
        assert torch.equal(back, staging)
    if device == "cuda":  # one shape: the row -> piece map was built once, for the first scatter
        assert (copier.index_cache.misses, copier.index_cache.hits) == (1, 3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda unavailable)")
def test_cuda_scatters_queued_back_to_back_land_in_stream_order():
    """More scatters queued behind a busy stream than the pinned ring has slots: none waits (the ring grows),
    each lands, in the order queued on the copier stream."""
    cache, requests, lengths = _shifted_requests("cuda")
    copier = Copier(Arena(cache))
    total = int(lengths.sum())
    slots = len(copier._pinned)
    stagings = [torch.full((total,), k, dtype=torch.uint8, device="cuda") for k in range(20)]
    torch.cuda.synchronize()
    with torch.cuda.stream(copier._stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s: every upload below stays queued while the host goes on
    tickets = [copier.scatter(stagings[k], requests[k % 2], lengths) for k in range(20)]
    assert not tickets[0].is_done and len(copier._pinned) > slots
    for t in tickets:
        t.wait()
    for k in (18, 19):  # the last scatter of each destination set wins
        back = torch.zeros(total, dtype=torch.uint8, device="cuda")
        copier.gather(requests[k % 2], lengths, back).wait()
        assert bool((back == k).all())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda unavailable)")
def test_cuda_wide_rows_keep_every_bit_pattern():
    """16-byte rows are moved as complex128: NaN payloads (signalling and quiet) and -0.0 come through bitwise."""
    cache, requests, lengths = _shifted_requests("cuda")
    total = int(lengths.sum())
    words = np.random.default_rng(9).integers(0, 2**63, total // 8, dtype=np.int64)
    specials = np.array([0x7FF0000000000001, 0x7FF8DEADBEEF0001, -0x0010000000000001, -0x8000000000000000,
                         0x7FF0000000000000], dtype=np.int64)  # sNaN, qNaN with payload, NaN, -0.0, inf
    words[: specials.shape[0] * 50] = np.tile(specials, 50)
    staging = torch.from_numpy(words.view(np.uint8).copy()).cuda()
    copier = Copier(Arena(cache))
    copier.scatter(staging, requests[0], lengths).wait()
    back = torch.zeros(total, dtype=torch.uint8, device="cuda")
    copier.gather(requests[0], lengths, back).wait()
    assert torch.equal(back, staging)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda unavailable)")
def test_cuda_scatter_runs_on_the_copiers_stream_and_is_done_only_when_its_event_is():
    """The scatter returns while its stream is still busy (the caller never waits), the caller's stream is not
    held behind it, and is_done turns True only once the bytes are in place."""
    cache, requests, lengths = _shifted_requests("cuda")
    copier = Copier(Arena(cache))
    total = int(lengths.sum())
    staging = torch.full((total,), 0xA5, dtype=torch.uint8, device="cuda")
    # Every kernel loaded once first (CUDA's lazy module loading may wait for the device), then a fresh index
    # cache: the scatter under test misses it and must build its maps without waiting for the busy stream.
    copier.scatter(staging, requests[0], lengths).wait()
    marker = torch.zeros(1, device="cuda")
    marker += 1
    copier.index_cache = IndexCache(copier.device)
    torch.cuda.synchronize()
    with torch.cuda.stream(copier._stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clock cycles ahead of the scatter on its stream
    ticket = copier.scatter(staging, requests[0], lengths)
    assert not ticket.is_done and ticket.elapsed_s == 0.0
    marker += 1  # on the caller's (default) stream: not queued behind the copier's stream
    torch.cuda.current_stream().synchronize()
    assert not ticket.is_done
    deadline = time.monotonic() + 30
    while not ticket.is_done:
        assert time.monotonic() < deadline, "scatter not done in time"
    assert ticket.elapsed_s > 0 and 0 <= ticket.index_s <= ticket.elapsed_s
    back = torch.zeros(total, dtype=torch.uint8, device="cuda")
    copier.gather(requests[0], lengths, back).wait()
    assert bool((back == 0xA5).all())


class _Event:
    def __init__(self, done: bool):
        self.done, self.waited = done, False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = self.done = True


def test_the_pinned_ring_reuses_finished_slots_and_grows_instead_of_waiting(monkeypatch):
    """Bookkeeping only (CPU has no pinned memory): a slot whose upload ran is reused, a busy ring grows, and
    only past its cap is the oldest upload waited for."""
    monkeypatch.setattr(gather_scatter, "_PINNED_MAX", 3)
    ring = gather_scatter._PinnedRing(2)
    first, second = ring._slots
    first[1], second[1] = _Event(True), _Event(False)
    assert ring._free_slot() is first and len(ring) == 2  # its upload ran: reused
    first[1] = _Event(False)
    grown = ring._free_slot()  # both queued: a third slot, no wait
    assert grown is not first and grown is not second and len(ring) == 3
    grown[1] = _Event(False)
    waited = ring._free_slot()  # at the cap: the oldest is waited for
    assert len(ring) == 3 and waited[1].waited
