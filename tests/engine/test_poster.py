"""The consumer's posting thread (engine/poster.py) through a real NIXL agent reading its own memory.

Bytes move through NIXL (UCX on DRAM); the races are made deterministic by holding the agent's
lock from the test, which parks the posting thread before its NIXL calls.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from hybrid_transfer.engine.agent import NixlAgent, XferState
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.poster import Poster
from hybrid_transfer.errors import EngineError

SIZE = 1 << 16


class _Region:
    def __init__(self, array: np.ndarray):
        self.addr, self.length, self.device_id, self.is_cuda = array.ctypes.data, array.nbytes, 0, False


@pytest.fixture
def loopback():
    """An agent with a posting thread over one registered buffer: source half, destination half."""
    buf = np.zeros(2 * SIZE, dtype=np.uint8)
    buf[:SIZE] = np.arange(SIZE, dtype=np.uint64).astype(np.uint8)
    agent = NixlAgent("poster-test", EngineConfig(), post_thread=True)
    agent.register([_Region(buf)])
    yield agent, buf
    agent.close()


def _descs(buf: np.ndarray, first: int, count: int, dst_shift: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """``count`` pieces of 1 KiB from offset ``first`` of the source half into the destination half."""
    off = (first + np.arange(count, dtype=np.int64)) * 1024
    remote = np.stack([buf.ctypes.data + off, np.full(count, 1024), np.zeros(count, dtype=np.int64)], axis=1)
    local = remote.copy()
    local[:, 0] += dst_shift
    return local, remote


def _wait(agent: NixlAgent, xfer, timeout_s: float = 20.0) -> XferState:
    deadline = time.monotonic() + timeout_s
    while agent.check(xfer) is XferState.PROC:
        agent.get_notifs()
        assert time.monotonic() < deadline, "READ not finished in time"
    return xfer.state


def test_a_handed_over_read_moves_its_bytes_and_releases(loopback):
    agent, buf = loopback
    assert agent.has_post_thread
    local, remote = _descs(buf, 0, SIZE // 1024)
    xfer = agent.post_read(agent.name, local, remote)
    assert _wait(agent, xfer) is XferState.DONE
    assert np.array_equal(buf[SIZE:2 * SIZE], buf[:SIZE])
    assert agent.release(xfer) and agent.num_live_handles == 0


def test_a_read_released_before_its_post_is_never_posted(loopback):
    agent, buf = loopback
    first_local, first_remote = _descs(buf, 0, 8)
    second_local, second_remote = _descs(buf, 8, 8)
    with agent._guard:  # the posting thread takes the first READ and waits here, before any NIXL call
        first = agent.post_read(agent.name, first_local, first_remote)
        second = agent.post_read(agent.name, second_local, second_remote)
        assert agent.check(second) is XferState.PROC  # not posted: NIXL is not asked
        assert not agent.release(second)  # cancelled, but it may be mid-post: not freed yet
        assert agent.num_live_handles == 2
    assert _wait(agent, first) is XferState.DONE
    assert _wait(agent, second) is XferState.ERR
    assert "released before it was posted" in str(second.error)
    assert agent.release(second) and agent.release(first)
    assert np.array_equal(buf[SIZE:SIZE + 8 * 1024], buf[:8 * 1024])
    assert not buf[SIZE + 8 * 1024:SIZE + 16 * 1024].any()  # the cancelled READ wrote nothing


def test_a_read_that_nixl_refuses_fails_on_its_handle(loopback):
    agent, buf = loopback
    local, remote = _descs(buf, 0, 4)
    remote[:, 0] += 1 << 40  # outside every registered region of the peer
    xfer = agent.post_read(agent.name, local, remote)  # returns at once: the error comes with a check
    assert _wait(agent, xfer) is XferState.ERR
    assert isinstance(xfer.error, EngineError) and xfer.error.operation == "post READ"
    assert agent.release(xfer) and agent.num_live_handles == 0


def test_close_cancels_what_is_queued_and_stops_the_thread(loopback):
    agent, buf = loopback
    local, remote = _descs(buf, 0, 8)
    with agent._guard:
        xfers = [agent.post_read(agent.name, local, remote) for _ in range(3)]
        closer = threading.Thread(target=agent.close)
        closer.start()
        time.sleep(0.05)
    closer.join(10)
    assert not closer.is_alive()
    assert agent.num_live_handles == 0 and all(x.is_released for x in xfers)
    with pytest.raises(EngineError, match="closed"):
        agent.post_read(agent.name, local, remote)


def test_poster_runs_jobs_in_order_and_bounds_its_queue():
    gate, seen = threading.Event(), []

    def post(job):
        gate.wait(10)
        seen.append(job)

    poster = Poster("bounded", post, max_queued=2)
    poster.submit(0)  # taken by the thread, which then waits on the gate
    deadline = time.monotonic() + 10
    while poster.num_queued and time.monotonic() < deadline:
        time.sleep(0.001)
    poster.submit(1)
    poster.submit(2)
    with pytest.raises(EngineError, match="limit 2"):
        poster.submit(3)
    gate.set()
    assert poster.close()
    assert seen == [0, 1, 2]
    with pytest.raises(EngineError, match="stopped"):
        poster.submit(4)


def test_a_failed_thread_set_up_fails_every_read(tmp_path):
    buf = np.zeros(2 * SIZE, dtype=np.uint8)

    def broken() -> None:
        raise RuntimeError("no device here")

    agent = NixlAgent("poster-broken", EngineConfig(), post_thread=True, thread_init=broken)
    try:
        agent.register([_Region(buf)])
        local, remote = _descs(buf, 0, 2)
        xfer = agent.post_read(agent.name, local, remote)
        assert _wait(agent, xfer) is XferState.ERR
        assert "no device here" in str(xfer.error)
    finally:
        agent.close()


def test_a_poll_never_waits_for_the_posting_thread_and_loses_nothing(loopback):
    """While the posting thread holds the agent's lock (mid-post), a poll's NIXL calls return at once:
    ``get_notifs`` gives nothing yet and ``release`` says "not yet"; once the lock is free the buffered
    notification arrives and the READ is freed. A poll then never waits for a step's long post."""
    agent, buf = loopback
    local, remote = _descs(buf, 0, 8)
    xfer = agent.post_read(agent.name, local, remote)
    assert _wait(agent, xfer) is XferState.DONE
    agent.send_notif(agent.name, b"kept")
    held, let_go = threading.Event(), threading.Event()

    def hold_the_lock():  # stands in for the posting thread inside a long create + post
        with agent._guard:
            held.set()
            let_go.wait(30)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    assert held.wait(10)
    got = {}
    poll = threading.Thread(target=lambda: got.update(notifs=agent.get_notifs(), released=agent.release(xfer)))
    poll.start()
    poll.join(10)
    alive = poll.is_alive()
    let_go.set()
    holder.join(10)
    poll.join(10)
    assert not alive, "a poll waited for the lock the posting thread holds"
    assert got == {"notifs": {}, "released": False} and not xfer.is_released
    deadline, notifs = time.monotonic() + 20, {}
    while not notifs and time.monotonic() < deadline:
        notifs = agent.get_notifs()
    assert notifs == {agent.name: [b"kept"]}
    assert agent.release(xfer) and agent.num_live_handles == 0
