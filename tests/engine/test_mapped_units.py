"""The mapped path's parts without processes (issue 28): who gets a handle, the row copy, range checks, names.

The end-to-end tests (real processes, real shared memory) are in test_mapped.py and test_mapped_faults.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import mmap
import os
import secrets
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import TINY
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import EngineConfig, auth, handshake, wire
from hybrid_transfer.engine.handshake import ListenerAuth, ListenerStats, ProducerCard
from hybrid_transfer.engine.mapped import host_copy, shm
from hybrid_transfer.engine.mapped.host import host_key
from hybrid_transfer.engine.mapped.offer import make_offer
from hybrid_transfer.engine.mapped.source import MappedSource
from hybrid_transfer.errors import ConfigError, MappingError, PeerDisconnectedError, RangeError
from hybrid_transfer.layout import RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.plan.cost import MAPPED_GPU_COST, preset_for
from hybrid_transfer.plan.rank import describe_rank
from hybrid_transfer.plan.types import PlanMode

SECRET = b"mapped-units-secret-0123456789abcd"
MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
OFFER = wire.MapOffer(kind="shm", host=host_key(), regions=(
    wire.MapRegion(addr=1 << 20, length=4096, handle=b"ht-1-" + b"0" * 32),))


def _card() -> ProducerCard:
    return ProducerCard(MODEL, fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 20, 1 << 24], 8),
                        "prefill-p0", b"metadata", "prefill", 11, ("tcp://127.0.0.1:1",), mapping=OFFER)


def _request(**fields) -> bytes:
    return handshake.make_request(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 16),
                                  "decode-c0", "decode", **fields)


def _answer(card, data, secured=None):
    return wire.decode(handshake.answer(card, data, ListenerStats(), lambda *a: None, secured))[1]


def test_a_handle_goes_only_to_an_authenticated_consumer_on_this_host_that_can_open_its_kind():
    card = _card()
    asks = {"map_host": host_key(), "map_kinds": ("shm",)}
    # No secret on the producer: accepted, never a mapping, whatever the request asks for.
    open_reply = _answer(card, _request(**asks))
    assert open_reply.accepted and open_reply.mapping is None
    secured = ListenerAuth(SECRET, auth.Challenges(time.monotonic, 60.0, 16))
    cn = auth.new_nonce()
    challenge = _answer(card, _request(client_nonce=cn, **asks), secured)
    assert isinstance(challenge, wire.AuthChallenge)  # nothing of the cache before the proof
    wrong = auth.proof(b"not-the-secret-0123456789abcdef", "consumer", cn, challenge.server_nonce, "prefill-p0",
                       "decode-c0")
    refused = _answer(card, _request(client_nonce=cn, server_nonce=challenge.server_nonce, proof=wrong, **asks),
                      secured)
    assert not refused.accepted and refused.mapping is None

    def proven(**fields):
        cn = auth.new_nonce()
        ch = _answer(card, _request(client_nonce=cn, **fields), secured)
        proof = auth.proof(SECRET, "consumer", cn, ch.server_nonce, "prefill-p0", "decode-c0")
        return _answer(card, _request(client_nonce=cn, server_nonce=ch.server_nonce, proof=proof, **fields), secured)

    assert proven(**asks).mapping == OFFER
    assert proven().mapping is None  # asked for nothing
    assert proven(map_host="another-host", map_kinds=("shm",)).mapping is None
    assert proven(map_host=host_key(), map_kinds=("cuda_ipc",)).mapping is None
    assert proven(**asks).accepted


def test_a_producer_offers_shared_memory_only_with_a_secret_and_never_under_nixl():
    cache = HybridCache.allocate(GEOMETRY, 4, shared=True)
    try:
        assert make_offer(cache, "auto", None) is None
        assert make_offer(cache, "nixl", SECRET) is None
        offer = make_offer(cache, "auto", SECRET)
        assert offer.kind == "shm" and offer.host == host_key()
        assert [(r.addr, r.length) for r in offer.regions] == [(r.addr, r.length) for r in cache.regions]
        assert [r.handle.decode() for r in offer.regions] == cache.shared_segments.names
    finally:
        cache.shared_segments.close()
    assert make_offer(HybridCache.allocate(GEOMETRY, 4), "auto", SECRET) is None  # plain memory: NIXL only
    with pytest.raises(ConfigError, match="read_transport"):
        EngineConfig(read_transport="fast").validate()


def test_wire_v11_fields_are_last_defaulted_and_bounded():
    assert wire.PROTOCOL_VERSION == 11
    assert wire.HandshakeRequest.__struct_fields__[-2:] == ("map_host", "map_kinds")
    assert wire.HandshakeReply.__struct_fields__[-1] == "mapping"
    old = wire.encode(wire.HandshakeReply(accepted=True), "d")
    assert wire.decode(old)[1].mapping is None
    too_many = wire.MapOffer(kind="shm", host="h", regions=(OFFER.regions[0],) * (wire.MAX_MAP_REGIONS + 1))
    with pytest.raises(Exception, match="length"):
        wire.decode(wire.encode(wire.HandshakeReply(accepted=True, mapping=too_many), "d"))


@pytest.mark.parametrize("method", ["readv", "rows"])
@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 40)), min_size=1, max_size=60), st.integers(0, 2**31))
def test_the_host_copy_moves_exactly_the_ranges_and_nothing_else(method, ranges, seed):
    rng = np.random.default_rng(seed)
    lengths = np.asarray([n for n, _ in ranges], np.int64)
    gaps = np.asarray([g for _, g in ranges], np.int64)
    src_off = np.cumsum(lengths + gaps) - lengths  # a gap before each range
    dst_off = np.cumsum((lengths + gaps)[::-1])[::-1] - lengths - gaps + gaps  # another order
    src = rng.integers(0, 256, int(src_off.max() + lengths.max() + 1), dtype=np.uint8)
    dst = np.full(int(dst_off.max() + lengths.max() + 64), 0xA5, np.uint8)
    expected = dst.copy()
    for d, s, n in zip(dst_off, src_off, lengths, strict=True):
        expected[d:d + n] = src[s:s + n]
    moved = host_copy.copy_ranges(dst.ctypes.data + dst_off, src.ctypes.data + src_off, lengths, method=method,
                                  max_chunk_bytes=4096)
    assert moved == int(lengths.sum()) and np.array_equal(dst, expected)


def test_readv_takes_more_ranges_than_one_call_and_refuses_an_unmapped_source():
    n = host_copy.IOV_MAX * 2 + 5
    src = np.arange(n * 8, dtype=np.uint8)
    dst = np.zeros(n * 8, np.uint8)
    offs = np.arange(n, dtype=np.int64)[::-1] * 8
    assert host_copy.copy_ranges(dst.ctypes.data + offs, src.ctypes.data + offs, np.full(n, 8), method="readv") == n * 8
    assert np.array_equal(dst, src)
    with pytest.raises(MappingError, match="process_vm_readv moved"):
        host_copy.copy_ranges(np.asarray([dst.ctypes.data]), np.asarray([8]), np.asarray([8]), method="readv")


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 700), min_size=1, max_size=40), st.integers(1, 300))
def test_readv_cuts_long_ranges_and_big_calls_below_the_kernels_per_call_limit(sizes, call_bytes):
    # Linux moves at most 2 GiB - 4 KiB per process_vm_readv and returns a short count past it (seen on a
    # 3.5 GB step): with CALL_BYTES shrunk, ranges longer than it and calls summing past it still arrive whole.
    lengths = np.asarray(sizes, np.int64)
    src_off = np.cumsum(lengths + 3) - lengths
    dst_off = np.cumsum(lengths) - lengths
    src = np.random.default_rng(len(sizes)).integers(0, 256, int(src_off[-1] + lengths[-1]), dtype=np.uint8)
    dst = np.zeros(int(lengths.sum()), np.uint8)
    asked, readv = [], host_copy._READV  # noqa: SLF001 - the bytes each system call is asked for

    def counting(pid, local, k, remote, k2, flags):
        asked.append(int(np.frombuffer((ctypes.c_int64 * (2 * k)).from_address(local), np.int64)[1::2].sum()))
        return readv(pid, local, k, remote, k2, flags)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host_copy, "CALL_BYTES", call_bytes)
        mp.setattr(host_copy, "_READV", counting)
        moved = host_copy.copy_ranges(dst.ctypes.data + dst_off, src.ctypes.data + src_off, lengths, method="readv")
    assert moved == int(lengths.sum()) and max(asked) <= call_bytes and sum(asked) == moved
    assert np.array_equal(dst, np.concatenate([src[o:o + n] for o, n in zip(src_off, lengths, strict=True)]))


def test_a_mapping_refuses_ranges_outside_its_regions_and_every_post_once_invalid():
    buf = mmap.mmap(-1, 8192)
    view = np.frombuffer(buf, np.uint8)

    class _Opened:
        addr = int(view.__array_interface__["data"][0])

        def close(self):
            pass

    source = MappedSource("prefill-p0", "shm", [1 << 30], [8192], [_Opened()])
    got = source.translate(np.asarray([(1 << 30) + 16]), np.asarray([100]))
    assert got.tolist() == [_Opened.addr + 16]
    with pytest.raises(RangeError) as info:
        source.translate(np.asarray([1 << 30, (1 << 30) + 8100]), np.asarray([8, 100]))
    assert info.value.addr == (1 << 30) + 8100 and info.value.length == 100
    assert not source.covers(np.asarray([(1 << 30) - 1]), np.asarray([4]))
    source.invalidate("producer engine restarted")
    with pytest.raises(PeerDisconnectedError, match="restarted"):
        source.translate(np.asarray([1 << 30]), np.asarray([8]))
    assert source.close() == [] and not source.is_valid


class _At:
    def __init__(self, addr):
        self.addr = addr

    def close(self):
        pass


@settings(max_examples=80, deadline=None)
@given(ranges=st.lists(st.tuples(st.integers(0, 3), st.integers(-64, 4200), st.integers(0, 200)), max_size=12))
def test_one_lookup_translates_exactly_the_ranges_covers_accepts(ranges):
    # Three regions of 4 KiB with gaps, offered out of order; each range is (region, offset, length), the offset
    # may fall before its region or run past it. Oracle: per range, the region whose span holds it whole.
    bases, here = [3 << 20, 1 << 20, 2 << 20], [7 << 30, 5 << 30, 6 << 30]
    source = MappedSource("prefill-p0", "shm", bases, [4096] * 3, [_At(a) for a in here])
    addr = np.asarray([bases[r % 3] + off for r, off, _ in ranges], np.int64)
    length = np.asarray([n for _, _, n in ranges], np.int64)
    inside = [next((k for k, b in enumerate(bases) if b <= a and a + n <= b + 4096), None)
              for a, n in zip(addr.tolist(), length.tolist(), strict=True)]
    got = source.translate_covered(addr, length)
    assert source.covers(addr, length) == (got is not None) == all(k is not None for k in inside)
    if got is not None:
        want = [here[k] + a - bases[k] for k, a in zip(inside, addr.tolist(), strict=True)]
        assert got.tolist() == want == source.translate(addr, length).tolist()


def test_a_segment_name_from_a_peer_must_be_one_of_ours_and_opens_read_only(tmp_path):
    for hostile in ("../etc/passwd", "ht-1-" + "g" * 32, "ht-1-" + "0" * 31, "/dev/shm/ht-1-" + "0" * 32):
        with pytest.raises(MappingError):
            shm.ReadOnlyMapping(hostile, 16)
    segments = shm.SharedSegments(4096, 1)
    try:
        opened = shm.ReadOnlyMapping(segments.names[0], 4096)
        with pytest.raises(MappingError, match="holds 4096 bytes"):
            shm.ReadOnlyMapping(segments.names[0], 8192)
        view = np.asarray(host_copy._Iface(opened.addr, 16))
        assert view.tolist() == [0] * 16
        opened.close()
        opened.close()  # idempotent
        assert oct(os.stat(os.path.join(shm.SHM_DIR, segments.names[0])).st_mode & 0o777) == "0o600"
    finally:
        segments.close()
    assert not os.path.exists(os.path.join(shm.SHM_DIR, segments.names[0]))


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_sweep_removes_only_unlocked_segments_of_dead_processes():
    dead = _dead_pid()
    orphan, held, live = (f"ht-{pid}-{secrets.token_hex(16)}" for pid in (dead, dead, os.getpid()))
    fds = [os.open(os.path.join(shm.SHM_DIR, n), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
           for n in (orphan, held, live)]
    try:
        fcntl.flock(fds[1], fcntl.LOCK_SH)  # a creator alive in another PID namespace holds its lock
        removed = shm.sweep_orphans()
        assert orphan in removed and held not in removed and live not in removed
        assert not os.path.exists(os.path.join(shm.SHM_DIR, orphan))
        assert all(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in (held, live))
    finally:
        for fd, name in zip(fds, (orphan, held, live), strict=True):
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(shm.SHM_DIR, name))


def test_a_killed_producers_segments_are_removed_by_the_next_process_that_allocates():
    code = ("import os, signal, sys; from hybrid_transfer.engine.mapped import shm; "
            "s = shm.SharedSegments(4096, 2); print(' '.join(s.names), flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    names = child.stdout.split()
    assert child.returncode == -9 and len(names) == 2
    assert all(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)  # SIGKILL ran no cleanup
    allocate = "from hybrid_transfer.engine.mapped import shm; shm.SharedSegments(4096, 1).close()"
    fresh = subprocess.run([sys.executable, "-c", allocate], capture_output=True, text=True, timeout=60)
    assert fresh.returncode == 0, fresh.stderr
    assert not any(os.path.exists(os.path.join(shm.SHM_DIR, n)) for n in names)
    assert "shared-memory segments of dead processes" in fresh.stderr  # said, with how many


def test_auto_on_a_mapped_link_plans_direct_where_nixl_would_pack():
    # A P2->D8 decode rank's fragmented share of a 397B request: 750 descriptors, ~150 MB. Over NIXL the
    # descriptors' cost makes pack pay on a GPU; over a mapping they cost next to nothing and direct wins.
    counts, nbytes = (750,), (150 << 20,)
    assert preset_for(True).choose_all(counts, nbytes) is PlanMode.PACK
    assert preset_for(True, "mapped") is MAPPED_GPU_COST
    assert MAPPED_GPU_COST.choose_all(counts, nbytes) is PlanMode.COALESCED
    with pytest.raises(ValueError):
        preset_for(True, "rdma")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5_000), min_size=0, max_size=40), st.integers(1, 1_500))
def test_the_copiers_chunk_table_covers_each_range_exactly_in_chunks_of_at_most_the_chunk(lengths, chunk):
    from hybrid_transfer.engine.mapped.cuda_ipc import chunk_table

    n = len(lengths)
    lengths_a = np.asarray(lengths, np.int64)
    src = np.arange(n, dtype=np.int64) * 10_000 + 7
    dst = np.arange(n, dtype=np.int64) * 10_000 + 3_000_000
    table = chunk_table(dst, src, lengths_a, chunk)
    assert table.shape[0] == 3 and table.dtype == np.int64
    # The oracle: walk each range in steps of ``chunk``.
    want = [(s + o, d + o, min(chunk, n_ - o)) for s, d, n_ in zip(src.tolist(), dst.tolist(), lengths, strict=True)
            for o in range(0, n_, chunk)]
    assert [tuple(c) for c in table.T.tolist()] == want
