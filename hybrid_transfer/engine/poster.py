"""A thread that creates and posts a consumer agent's READs, so the owner thread does not wait on UCX.

Why: on GPU caches UCX spends a few microseconds of CPU per descriptor inside NIXL's create and
post calls (docs/tuning.md#posting-thread); a decode rank posting one request after another then
spends that time on its own thread instead of planning and bookkeeping the next request. NIXL's
Python bindings release the GIL inside those calls (measured: a second Python thread keeps its
full rate during a ``transfer()``), so a second thread overlaps them with the owner's Python work.

Contract (see NixlAgent): every NIXL call of the agent, from either thread, is made under the
agent's one lock, so NIXL never sees two calls at once. A READ handed over here is PROC and
unposted until this thread has posted it; a check before then does not call NIXL, and a release
before then only cancels it (the READ is never posted) and reports "not yet", because the
handle may be mid-post. The queue is bounded (``max_queued``); ``submit`` raises when it is full,
and ``close`` stops the thread within ``join_s``.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from hybrid_transfer.errors import EngineError

log = logging.getLogger(__name__)

MAX_QUEUED = 4096  # READs handed over and not yet posted, per agent (a poll loop posts far fewer)


class Poster:
    """One daemon thread that runs ``post(job)`` for each submitted job, in submission order.

    Args:
        name: thread name (the agent's), for logs and debuggers.
        post: called on this thread for each job; it must not raise (it records errors on the job).
        thread_init: called once on the thread before the first job (e.g. make a CUDA device current).
    """

    def __init__(self, name: str, post: Callable[[Any], None], *, thread_init: Callable[[], None] | None = None,
                 max_queued: int = MAX_QUEUED):
        self._name = name
        self._post = post
        self._thread_init = thread_init
        self._max_queued = max_queued
        self._jobs: collections.deque = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self.init_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"post-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Any) -> None:
        """Queue ``job`` for posting (never blocks).

        Raises:
            EngineError: the thread has stopped, or ``max_queued`` jobs are already waiting.
        """
        with self._wake:
            if self._stopping or not self._thread.is_alive():
                raise EngineError("the posting thread has stopped", operation="post READ", agent=self._name)
            if len(self._jobs) >= self._max_queued:
                raise EngineError(f"{len(self._jobs)} READs already wait for the posting thread (limit "
                                  f"{self._max_queued})", operation="post READ", agent=self._name)
            self._jobs.append(job)
            self._wake.notify()

    @property
    def num_queued(self) -> int:
        return len(self._jobs)

    def close(self, join_s: float = 5.0) -> bool:
        """Post what is queued, stop the thread; False when it did not stop within ``join_s``."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        self._thread.join(join_s)
        if self._thread.is_alive():
            log.warning("posting thread %s did not stop within %.1f s", self._thread.name, join_s)
            return False
        return True

    def _run(self) -> None:
        if self._thread_init is not None:
            try:
                self._thread_init()
            except BaseException as exc:  # every job then fails on its own (the post records it)
                self.init_error = exc
                log.warning("posting thread %s: set-up failed: %s", self._thread.name, exc)
        while True:
            with self._wake:
                while not self._jobs and not self._stopping:
                    self._wake.wait()
                if not self._jobs:
                    return
                job = self._jobs.popleft()
            self._post(job)
