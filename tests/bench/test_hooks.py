"""NixlTimer: NIXL's data-path calls on the worker thread are timed; other calls and threads pass through."""

from __future__ import annotations

import threading
import time

from hybrid_transfer.bench.hooks import TIMED_CALLS, NixlTimer, time_nixl_calls


class _Agent:
    """A stand-in nixl_agent (bookkeeping only): transfer sleeps, so a timed call adds measurable time."""

    name = "fake"

    def transfer(self, handle):
        time.sleep(0.002)
        return f"posted {handle}"

    def get_agent_metadata(self):
        time.sleep(0.002)
        return b"meta"


def test_timed_calls_on_the_owning_thread_add_their_wall_time():
    timer = NixlTimer(_Agent())
    assert timer.transfer("h") == "posted h" and timer.spent > 0
    assert "transfer" in TIMED_CALLS and "get_new_notifs" in TIMED_CALLS


def test_setup_calls_and_other_threads_are_not_counted():
    timer = NixlTimer(_Agent())
    assert timer.get_agent_metadata() == b"meta" and timer.name == "fake"
    out = []
    thread = threading.Thread(target=lambda: out.append(timer.transfer("x")))  # a posting thread's call
    thread.start()
    thread.join(timeout=5)
    assert out == ["posted x"] and timer.spent == 0.0


def test_time_nixl_calls_wraps_a_consumers_agent_once():
    class _Wrapper:
        _agent = _Agent()

    class _Consumer:
        agent = _Wrapper()

    consumer = _Consumer()
    timer = time_nixl_calls(consumer)
    assert consumer.agent._agent is timer and time_nixl_calls(consumer) is timer  # a second open reuses it
