"""Worker-side helpers for the fault and churn tests, run through harness ``call`` (``worker.call("call", f, ...)``).

They live in a module of their own so spawned workers can import them by name. Each function
takes the worker's state first. Producers may run on a ManualClock that the test advances, so
lease expiry is decided by the test, not by wall time; consumers keep the real clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from harness import WAIT_POLL_S, _Rank


class ManualClock:
    """A clock only the test moves."""

    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ---- ranks with a clock the test controls; pausing a rank ----------------------------------
def create_producer(state, key, spec, engine_id, incarnation, config, manual_clock: bool):
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Producer

    clock = ManualClock() if manual_clock else time.monotonic
    cache = HybridCache.allocate(spec.geometry(), spec.num_blocks)
    producer = Producer(cache, config, engine_id=engine_id, incarnation=incarnation, clock=clock)
    state.ranks[key] = _Rank(producer, True)
    state.extra[f"{key}/clock"] = clock
    return producer.address


def advance_clock(state, key, seconds: float) -> float:
    clock = state.extra[f"{key}/clock"]
    clock.now += seconds
    return clock.now


def pause(state, key) -> None:
    """Stop polling a rank: its NIXL agent is no longer progressed (a READ from it stays in PROC)."""
    state.extra[f"{key}/paused"] = state.ranks.pop(key)


def resume(state, key) -> None:
    state.ranks[key] = state.extra.pop(f"{key}/paused")


def _engine(state, key):
    rank = state.ranks.get(key) or state.extra[f"{key}/paused"]
    engine = rank.engine
    return getattr(engine, "inner", engine)


def status(state, key, request_ids=()) -> dict:
    """Counts for assertions: pinned / quarantined blocks, live handles, terminal counts, stats."""
    from dataclasses import asdict

    engine = _engine(state, key)
    out = {"live_handles": engine.agent.num_live_handles, "terminal": engine.terminal_counts,
           "stats": asdict(engine.stats)}
    if hasattr(engine, "hold_state"):
        holds = {rid: engine._book.get(rid) for rid in request_ids}
        out |= {"pinned_blocks": engine.num_held_blocks, "held_requests": engine.num_held_requests,
                "holds": {rid: h.state.value if h else None for rid, h in holds.items()},
                "expires_at": {rid: h.expires_at if h else None for rid, h in holds.items()}}
    else:
        reqs = engine._requests
        out |= {"quarantined_blocks": engine.num_quarantined_blocks, "active": engine.num_active,
                "failure_causes": dict(engine.failure_causes),
                "reads": {rid: (reqs[rid].state.value, [h.state.name for h in reqs[rid].handles])
                          for rid in request_ids if rid in reqs}}
    return out


def wait_results(state, key, request_ids, timeout_s: float) -> dict:
    """Wait (polling every rank of the worker) until the consumer reported each request; full results."""
    rank = state.ranks[key]
    deadline = time.monotonic() + timeout_s
    while not all(r in rank.results for r in request_ids) and time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)
    out = {}
    for rid in request_ids:
        r = rank.results.pop(rid, None)
        out[rid] = None if r is None else {
            "state": r.state.value, "cause": r.cause.value if r.cause else None,
            "local_block_ids": r.local_block_ids, "elapsed_s": r.finished_at - r.started_at,
            "error_type": type(r.error).__name__ if r.error else None}
    return out


# ---- churn: requests with aborts scheduled at random moments, verified where they end -----------
@dataclass
class ChurnProducer:
    """Wraps a Producer: fills and holds requests, aborts each after a scheduled number of polls."""

    inner: Any
    aborts: dict = field(default_factory=dict)  # request id -> polls left before the abort
    released: dict = field(default_factory=dict)  # request id -> times released (must be 1)
    aborted_late: int = 0  # aborts that found nothing to abort (the hold had already ended)

    def poll(self):
        for rid, left in list(self.aborts.items()):
            if left > 0:
                self.aborts[rid] = left - 1
                continue
            del self.aborts[rid]
            if not self.inner.abort(rid):
                self.aborted_late += 1
        out = self.inner.poll()
        for rid in out:
            self.released[rid] = self.released.get(rid, 0) + 1
        return out

    def close(self):
        self.inner.close()


@dataclass
class ChurnConsumer:
    """Wraps a Consumer: starts reads, aborts each after a scheduled number of polls, verifies every DONE
    request's blocks the moment it is reported, then poisons them again (the embedder's reuse)."""

    inner: Any
    aborts: dict = field(default_factory=dict)
    expected: dict = field(default_factory=dict)  # request id -> (local RequestLayout, seed)
    outcomes: dict = field(default_factory=dict)  # request id -> list of (state, cause, verified)
    raised: dict = field(default_factory=dict)  # request id -> exception type name (start_read refused)

    def poll(self):
        for rid, left in list(self.aborts.items()):
            if left > 0:
                self.aborts[rid] = left - 1
                continue
            del self.aborts[rid]
            self.inner.abort(rid)
        results = self.inner.poll()
        for r in results:
            self._record(r)
        return results

    def _record(self, r) -> None:
        layout, seed = self.expected[r.request_id]
        verified = None
        if r.ok:
            verified = _blocks_hold(self.inner.cache, layout, seed)
        _poison_blocks(self.inner.cache, layout)
        why = r.cause.value if r.cause else getattr(r.error, "state", None)  # an abort: the state it hit
        self.outcomes.setdefault(r.request_id, []).append((r.state.value, why, verified))

    def close(self):
        self.inner.close()


def _blocks_hold(cache, layout, seed) -> bool:
    """Every page of the request's blocks equals what a correct transfer leaves there (the global oracle)."""
    import torch

    from hybrid_transfer.verify import expected_destination_many

    expected = expected_destination_many(cache, [(layout, seed)])
    page = cache.geometry.page_bytes
    ids = sorted(b for group in layout.block_ids for b in group)
    for actual, want in zip(cache.tensors, expected, strict=True):
        a, w = actual.view(cache.num_blocks, page), want.view(cache.num_blocks, page)
        index = torch.tensor(ids, dtype=torch.int64)
        if not torch.equal(a[index], w[index]):
            return False
    return True


def _poison_blocks(cache, layout) -> None:
    from hybrid_transfer.verify import POISON_BYTE

    page = cache.geometry.page_bytes
    for t in cache.tensors:
        pages = t.view(cache.num_blocks, page)
        for group in layout.block_ids:
            for b in group:
                pages[b].fill_(POISON_BYTE)


def churn_wrap(state, key) -> None:
    import torch

    # Thousands of tiny fills and checks: torch's intra-op threads only add wake-ups here, and with
    # every core busy a 2-thread region waits for a core (measured: a 128 KiB fill_ took 8 ms, not 10 us).
    torch.set_num_threads(1)
    rank = state.ranks[key]
    rank.engine = (ChurnProducer if rank.is_producer else ChurnConsumer)(rank.engine)


def churn_hold(state, key, items) -> list[bytes]:
    """items: (request id, producer RequestLayout, seed, nonce or None, abort_after or None); ticket bytes.

    abort_after -1 aborts inside this call, right after the hold (before the ticket leaves).
    """
    from hybrid_transfer.engine import encode_ticket
    from hybrid_transfer.verify import fill_source

    proxy = state.ranks[key].engine
    tickets = []
    for rid, layout, seed, nonce, abort_after in items:
        fill_source(proxy.inner.cache, layout, seed)
        tickets.append(encode_ticket(proxy.inner.hold(rid, layout.block_ids, layout.num_tokens, nonce=nonce)))
        if abort_after == -1:
            proxy.inner.abort(rid)
        elif abort_after is not None:
            proxy.aborts[rid] = abort_after
    return tickets


def churn_read(state, key, items) -> None:
    """items: (ticket bytes, local RequestLayout, seed, abort_after or None); -1 aborts right after start_read."""
    from hybrid_transfer.engine import decode_ticket

    proxy = state.ranks[key].engine
    for ticket_bytes, layout, seed, abort_after in items:
        ticket = decode_ticket(ticket_bytes)
        proxy.expected[ticket.request_id] = (layout, seed)
        try:
            proxy.inner.start_read(ticket, layout.block_ids, expected_state_position=layout.num_tokens)
        except Exception as exc:  # noqa: BLE001 - counted; the test requires none
            proxy.raised[ticket.request_id] = type(exc).__name__
            continue
        if abort_after == -1:
            proxy.inner.abort(ticket.request_id)
        elif abort_after is not None:
            proxy.aborts[ticket.request_id] = abort_after


def churn_wait(state, key, request_ids, timeout_s: float) -> dict:
    """Poll until this rank has finished with every request (released / reported); what it saw of each."""
    rank = state.ranks[key]
    proxy = rank.engine
    deadline = time.monotonic() + timeout_s
    if rank.is_producer:
        def finished():
            return all(r in proxy.released for r in request_ids)
    else:
        def finished():
            return all(r in proxy.outcomes or r in proxy.raised for r in request_ids)
    while not finished() and time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)
    if rank.is_producer:
        rank.freed.difference_update(request_ids)
        return {rid: proxy.released.get(rid, 0) for rid in request_ids}
    for rid in request_ids:
        rank.results.pop(rid, None)
    return {rid: proxy.outcomes.get(rid, [("raised", proxy.raised.get(rid), None)]) for rid in request_ids}


def churn_final(state, key, settle_s: float) -> dict:
    """Poll a while longer (stray acks and releases arrive), then the rank's final counts."""
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)
    proxy = state.ranks[key].engine
    out = status(state, key)
    if isinstance(proxy, ChurnProducer):
        out |= {"releases": sum(proxy.released.values()), "distinct_released": len(proxy.released),
                "pending_aborts": len(proxy.aborts), "aborted_late": proxy.aborted_late}
    else:
        out |= {"pending_aborts": len(proxy.aborts), "raised": dict(proxy.raised)}
    return out


def abort(state, key, request_id) -> bool:
    """The embedder's abort on a producer or consumer rank (paused or not)."""
    return _engine(state, key).abort(request_id)
