"""NIXL's own calls on a decode rank's worker thread, timed apart from the engine's Python (bench only).

vLLM calls a connector's ``start_load_kv`` and ``get_finished`` on its worker thread; the bench's decode
loop stands in for them (``Consumer.start_reads`` and ``Consumer.poll``). To split that thread's time into
NIXL's part and our own Python, the rank wraps its Consumer's nixl_agent in ``NixlTimer``: every data-path
call (descriptor lists, handles, transfers, state checks, releases, notifications) adds its wall time to
``spent``, when made on the thread that built the timer; calls on another thread (the posting thread with
``post_thread`` on) are passed through untimed, since they are not the worker thread's time.
"""

from __future__ import annotations

import threading
import time
from typing import Any

# The nixl_agent methods a Consumer calls per request or per poll (setup calls are not timed).
TIMED_CALLS = frozenset(("get_xfer_descs", "initialize_xfer", "transfer", "check_xfer_state", "release_xfer_handle",
                         "prep_xfer_dlist", "make_prepped_xfer", "release_dlist_handle", "send_notif",
                         "get_new_notifs"))


class NixlTimer:
    """Stands in for a nixl_agent: TIMED_CALLS made on the owning thread add to ``spent`` (seconds)."""

    def __init__(self, inner: Any):
        self._inner = inner
        self._thread = threading.get_ident()
        self.spent = 0.0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in TIMED_CALLS:
            return attr

        def timed(*args, **kwargs):
            if threading.get_ident() != self._thread:
                return attr(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - t0

        return timed


def time_nixl_calls(consumer: Any) -> NixlTimer:
    """Wrap ``consumer``'s nixl_agent (engine/agent.py NixlAgent._agent) in a NixlTimer and return the timer."""
    agent = consumer.agent
    inner = agent._agent  # noqa: SLF001 - the bench measures the engine from outside; no engine hook exists
    timer = inner if isinstance(inner, NixlTimer) else NixlTimer(inner)
    agent._agent = timer  # noqa: SLF001
    return timer
