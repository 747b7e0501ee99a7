"""Timing records from the rank processes, and the figures a variant reports (pure, no clocks).

The records are msgspec Structs: rank processes send them to the coordinator inside bench.messages replies.

Every time is ``time.monotonic()`` of the process that took it. CLOCK_MONOTONIC is one clock for
the whole host on Linux, so times of different processes on ONE host compare; never across hosts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import msgspec

from hybrid_transfer.errors import ConfigError


class RequestTiming(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request on one decode rank.

    t_post: just before start_read (or the ceiling's post); t_posted: when that call returned;
    t_notify: the consumer's clock when it saw DONE and notified (ReadResult.finished_at);
    t_done: when the poll that reported DONE returned: the bytes are in place, producers told.
    completion_s: this request's share of that poll call.
    t_read_done: when every READ of the request was seen DONE (the engine's posted_at + read_s; the
    ceiling and the copy: t_done). 0.0 when unknown. Between it and t_done lie pack's scatter and the
    wait for the producers' claim confirmations.
    """

    request_id: str
    t_post: float
    t_posted: float
    t_notify: float
    t_done: float
    num_bytes: int
    num_descriptors: int
    completion_s: float = 0.0
    # Pack mode, as the engine reports it (ReadResult): the producer's gather (at hold, off the critical
    # path), the staging query round trip, the scatter (inside the window), and sources read each way.
    gather_s: float = 0.0
    query_s: float = 0.0
    scatter_s: float = 0.0
    packed_sources: int = 0
    fallback_sources: int = 0
    t_read_done: float = 0.0

    @property
    def read_s(self) -> float:
        """start_read returned -> every READ DONE (0 when unknown; clamped into [t_posted, t_done])."""
        if self.t_read_done <= 0.0:
            return 0.0
        return min(max(self.t_read_done, self.t_posted), self.t_done) - self.t_posted

    @property
    def settle_s(self) -> float:
        """Every READ DONE -> reported DONE: pack's scatter and the wait for claim confirmations."""
        return self.t_done - self.t_posted - self.read_s


class ConsumerRun(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decode rank's timed phase: its requests and the CPU seconds its process used meanwhile."""

    rank: int
    timings: tuple[RequestTiming, ...]
    cpu_s: float
    # The engine's worker-thread hooks in the window (bench/hooks.py): wall seconds inside the start_reads
    # calls and the polls that returned results, NIXL's own calls among them, and the start_reads calls made.
    hook_s: float = 0.0
    hook_nixl_s: float = 0.0
    steps: int = 0


class ProducerServe(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill rank during a timed phase: when it freed each request, its CPU seconds, its hold times."""

    rank: int
    freed_at: dict[str, float]
    cpu_s: float
    hold_s: tuple[float, ...] = ()


class PlanTiming(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Planner figures of one decode rank, measured outside the timed window (same planner, same ids)."""

    rank: int
    plan_s: tuple[float, ...]
    descriptors: tuple[int, ...]  # per request, after planning (what is posted)
    pieces: tuple[int, ...]  # per request: copy pieces of pack sources, descriptors otherwise


@dataclass(frozen=True)
class VariantStats:
    """The figures of one variant at one point; None where the variant has no such figure."""

    variant: str
    requests: int
    payload_bytes: int
    window_s: float
    gbps: float
    descriptors_per_request: float
    pieces_per_request: float | None
    plan_ms: float | None
    post_ms: float
    completion_ms: float
    overhead_ms: float  # per request and rank: start_read (plan, validation, post) + its share of the DONE poll
    p50_ms: float
    p99_ms: float
    notify_lag_p50_ms: float | None
    notify_lag_p99_ms: float | None
    hold_ms: float | None
    consumer_cpu_s: tuple[float, ...]
    producer_cpu_s: tuple[float, ...]
    gather_ms: float | None = None  # pack: median producer gather per (rank, request); None when nothing was packed
    query_ms: float | None = None
    scatter_ms: float | None = None
    packed_sources: int = 0  # (rank, request, source) reads through staging, whole window
    fallback_sources: int = 0  # pack / auto sources read directly after all (staging absent or full)
    verified: bool = False
    gbps_rounds: tuple[float, ...] = ()  # every round's GB/s, in round order (the figures are the median round's)
    # The time split per (decode rank, request), medians: post_ms, then read_ms (post returned -> every READ
    # DONE), then settle_ms (READs DONE -> reported DONE: scatter, claim confirmations); CPU per request.
    read_ms: float | None = None
    settle_ms: float | None = None
    consumer_cpu_ms_per_request: float = 0.0  # decode processes' CPU seconds / (decode rank, request) pairs
    producer_cpu_ms_per_request: float = 0.0  # prefill processes' CPU seconds / (prefill rank, request) pairs
    # Which way each decode rank read (auto's choice shows here): per rank, in rank order, the source reads
    # through staging per request (0: every source direct); staged_rounds: the same for every round, in round order.
    staged_per_rank: tuple[float, ...] = ()
    staged_rounds: tuple[tuple[float, ...], ...] = ()
    # Engine variants: worker-thread wall time per (decode rank, request) in the hooks (the start_reads calls
    # and the polls that collected results), NIXL's calls in it, the Python rest; requests per start_reads call.
    hook_ms: float | None = None
    hook_nixl_ms: float | None = None
    hook_python_ms: float | None = None
    requests_per_step: float | None = None


def percentile(values: Iterable[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default method).

    Raises:
        ConfigError: no values, or q outside [0, 100].
    """
    data = sorted(values)
    if not data:
        raise ConfigError("percentile of no values", field="values", value=[])
    if not 0 <= q <= 100:
        raise ConfigError(f"percentile q={q} must be in [0, 100]", field="q", value=q)
    pos = (len(data) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def median(values: Iterable[float]) -> float:
    return percentile(values, 50)


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def gbps(num_bytes: int, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes per second); 0 for an empty window."""
    return num_bytes / seconds / 1e9 if seconds > 0 else 0.0


def summarize(variant: str, runs: Sequence[ConsumerRun], serves: Sequence[ProducerServe] = (),
              plans: Sequence[PlanTiming] = ()) -> VariantStats:
    """Figures of one timed phase over every decode rank.

    GB/s: payload bytes of all ranks / (last DONE of any rank - first post of any rank).
    Request latency: post to DONE on one decode rank, over every (rank, request): ranks run their own
    loops, so a cross-rank span would mostly measure how far apart the ranks are scheduled.
    Notification lag: per request, last producer free - last consumer notify.

    Raises:
        ConfigError: no timings, or ranks that disagree on the request ids.
    """
    timings = [t for run in runs for t in run.timings]
    if not timings:
        raise ConfigError(f"variant {variant}: no request timings", field="runs", value=len(runs))
    ids = {t.request_id for t in runs[0].timings}
    for run in runs[1:]:
        if {t.request_id for t in run.timings} != ids:
            raise ConfigError(f"variant {variant}: decode rank {run.rank} timed other requests than rank "
                              f"{runs[0].rank}", field="runs", value=run.rank)
    first_post = min(t.t_post for t in timings)
    last_done = max(t.t_done for t in timings)
    payload = sum(t.num_bytes for t in timings)
    window = last_done - first_post
    per_request: dict[str, list[RequestTiming]] = {}
    for t in timings:
        per_request.setdefault(t.request_id, []).append(t)
    latencies_ms = [(t.t_done - t.t_post) * 1e3 for t in timings]
    descriptors = [sum(x.num_descriptors for x in ts) for ts in per_request.values()]
    lags_ms = _notify_lags_ms(per_request, serves)
    plan_s = [s for p in plans for s in p.plan_s]
    pieces = _per_request_sums([p.pieces for p in plans])
    holds = [s for sv in serves for s in sv.hold_s]
    packed = [t for t in timings if t.packed_sources]
    read = [t for t in timings if t.t_read_done > 0.0]
    num_requests = len(per_request)
    return VariantStats(
        variant=variant,
        requests=len(per_request),
        payload_bytes=payload,
        window_s=window,
        gbps=gbps(payload, window),
        descriptors_per_request=sum(descriptors) / len(descriptors),
        pieces_per_request=sum(pieces) / len(pieces) if pieces else None,
        plan_ms=median(plan_s) * 1e3 if plan_s else None,
        post_ms=median(t.t_posted - t.t_post for t in timings) * 1e3,
        completion_ms=median(t.completion_s for t in timings) * 1e3,
        overhead_ms=median(t.t_posted - t.t_post + t.completion_s for t in timings) * 1e3,
        p50_ms=percentile(latencies_ms, 50),
        p99_ms=percentile(latencies_ms, 99),
        notify_lag_p50_ms=percentile(lags_ms, 50) if lags_ms else None,
        notify_lag_p99_ms=percentile(lags_ms, 99) if lags_ms else None,
        hold_ms=median(holds) * 1e3 if holds else None,
        consumer_cpu_s=tuple(r.cpu_s for r in sorted(runs, key=lambda r: r.rank)),
        producer_cpu_s=tuple(s.cpu_s for s in sorted(serves, key=lambda s: s.rank)),
        gather_ms=median(t.gather_s for t in packed) * 1e3 if packed else None,
        query_ms=median(t.query_s for t in packed) * 1e3 if packed else None,
        scatter_ms=median(t.scatter_s for t in packed) * 1e3 if packed else None,
        packed_sources=sum(t.packed_sources for t in timings),
        fallback_sources=sum(t.fallback_sources for t in timings),
        read_ms=median(t.read_s for t in read) * 1e3 if read else None,
        settle_ms=median(t.settle_s for t in read) * 1e3 if read else None,
        consumer_cpu_ms_per_request=sum(r.cpu_s for r in runs) / len(timings) * 1e3,
        producer_cpu_ms_per_request=(sum(s.cpu_s for s in serves) / (num_requests * len(serves)) * 1e3
                                     if serves else 0.0),
        **_hook_figures(runs, len(timings)),
        staged_per_rank=tuple(sum(t.packed_sources for t in r.timings) / len(r.timings) if r.timings else 0.0
                              for r in sorted(runs, key=lambda r: r.rank)),
    )


def _hook_figures(runs: Sequence[ConsumerRun], num_timings: int) -> dict[str, float | None]:
    """Hook time per (decode rank, request), whole window; None for runs without steps (ceiling, copy)."""
    steps = sum(r.steps for r in runs)
    if not steps:
        return {}
    hook = sum(r.hook_s for r in runs) / num_timings * 1e3
    nixl = sum(r.hook_nixl_s for r in runs) / num_timings * 1e3
    return {"hook_ms": hook, "hook_nixl_ms": nixl, "hook_python_ms": hook - nixl,
            "requests_per_step": num_timings / steps}


def median_round(rounds: Sequence[VariantStats]) -> VariantStats:
    """The round whose GB/s is the median (the lower middle for an even count), carrying every round's GB/s.

    One real window's figures, not a mix: on a shared host a slow spell hits one round, not the result.
    """
    if not rounds:
        raise ConfigError("no rounds to choose from", field="rounds", value=0)
    ranked = sorted(rounds, key=lambda st: st.gbps)
    chosen = ranked[(len(ranked) - 1) // 2]
    return replace(chosen, gbps_rounds=tuple(st.gbps for st in rounds),
                   staged_rounds=tuple(st.staged_per_rank for st in rounds))


def _notify_lags_ms(per_request: dict[str, list[RequestTiming]], serves: Sequence[ProducerServe]) -> list[float]:
    if not serves:
        return []
    lags = []
    for rid, ts in per_request.items():
        freed = [s.freed_at[rid] for s in serves if rid in s.freed_at]
        if len(freed) == len(serves):
            lags.append((max(freed) - max(x.t_notify for x in ts)) * 1e3)
    return lags


def _per_request_sums(columns: Sequence[Sequence[int]]) -> list[int]:
    """Element-wise sums of per-rank, per-request counts (ranks list the same requests in order)."""
    if not columns:
        return []
    return [sum(c) for c in zip(*columns, strict=True)]
