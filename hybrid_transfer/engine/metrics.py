"""Metrics snapshots of a producer or consumer rank (issue 14): plain msgspec Structs, cheap to take.

``Producer.metrics()`` and ``Consumer.metrics()`` return a frozen snapshot; nothing here touches
NIXL. The consumer checks each finished READ's bytes against the bytes the layout says the request
needs (``plan.validate.expected_bytes``, computed from the rank geometry alone, not from the plan):
a difference fails the request with cause ``byte_count`` and is counted, never reported DONE.
``hybrid_transfer.engine.prometheus`` exports the snapshots when ``prometheus_client`` is installed.
See docs/metrics.md.
"""

from __future__ import annotations

import bisect
from collections import Counter

import msgspec

from hybrid_transfer.plan.types import PlanMode

# Upper bounds (seconds) of the post-to-DONE latency buckets; the last bucket is open (+inf).
LATENCY_BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)


class LatencySummary(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A histogram: ``counts[i]`` observations <= ``bounds_s[i]`` and > the bound before; the last entry: above all."""

    count: int = 0
    sum_s: float = 0.0
    min_s: float = 0.0
    max_s: float = 0.0
    bounds_s: tuple[float, ...] = LATENCY_BOUNDS_S
    counts: tuple[int, ...] = (0,) * (len(LATENCY_BOUNDS_S) + 1)

    @property
    def mean_s(self) -> float:
        return self.sum_s / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (``max_s`` for the open bucket); 0 when empty."""
        if not self.count:
            return 0.0
        rank, seen = q * self.count, 0
        for bound, n in zip((*self.bounds_s, self.max_s), self.counts, strict=True):
            seen += n
            if seen >= rank and n:
                return min(bound, self.max_s)
        return self.max_s


class Histogram:
    """The mutable recorder behind a LatencySummary."""

    def __init__(self, bounds_s: tuple[float, ...] = LATENCY_BOUNDS_S):
        self.bounds_s = bounds_s
        self.counts = [0] * (len(bounds_s) + 1)
        self.count, self.sum_s, self.min_s, self.max_s = 0, 0.0, 0.0, 0.0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, float(seconds))
        self.counts[bisect.bisect_left(self.bounds_s, seconds)] += 1
        self.min_s = seconds if not self.count else min(self.min_s, seconds)
        self.max_s = max(self.max_s, seconds)
        self.count += 1
        self.sum_s += seconds

    def snapshot(self) -> LatencySummary:
        return LatencySummary(self.count, self.sum_s, self.min_s, self.max_s, self.bounds_s, tuple(self.counts))


def bytes_agree(mode: PlanMode, moved: int, needed: int, packed: bool) -> bool:
    """Whether a finished READ moved what the request needs.

    Coalesced reads move exactly the payload. Naive reads move whole pages (tails included) and
    staged (pack) reads may move a padded staging slot, so for those at least the payload.
    """
    if (mode if type(mode) is PlanMode else PlanMode(mode)) is PlanMode.COALESCED and not packed:
        return moved == needed
    return moved >= needed


class ConsumerMetrics(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One consumer rank, since it started."""

    done: int
    failed: int
    aborted: int
    active: int  # requests not reported yet
    failures_by_cause: dict[str, int]  # FailureCause value -> requests reported FAILED with it
    bytes_needed: int  # sum over DONE requests of what the layout says each needs
    bytes_moved: int  # ... and of what their READs moved
    byte_mismatches: int  # READs whose bytes disagreed (each FAILED with cause byte_count, never DONE)
    descriptors: int  # descriptors posted, DONE requests
    reads_posted: int
    post_to_done: LatencySummary  # first READ posted -> DONE
    quarantined_blocks: int  # now
    rejected_messages: dict[str, int]  # notifications dropped by authentication, by cause
    unexpected_notifications: int
    claims_refused: int
    revokes: int
    links: int = 0  # producer engines linked now (live, handshaking or failed and backing off)
    link_failures: int = 0  # handshakes with an engine that failed (each starts a backoff; docs/security.md#links)
    links_evicted: int = 0  # failed links dropped, least recently used first, to make room (max_links)
    notifications_dropped: int = 0  # arrived while the backlog of unhandled notifications was full (engine/inbox.py)
    notifications_fetched: int = 0  # handed over by NIXL's notification fetch
    notification_fetch: LatencySummary = msgspec.field(default_factory=LatencySummary)  # time inside NIXL's fetch
    transports: dict[str, int] = msgspec.field(default_factory=dict)  # producer agents linked, by transport (engine/mapped/)
    reads_by_transport: dict[str, int] = msgspec.field(default_factory=dict)  # READs posted, per transport
    bytes_by_transport: dict[str, int] = msgspec.field(default_factory=dict)  # ... and their bytes


class ProducerMetrics(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One producer rank, since it started."""

    held_requests: int  # now
    pinned_blocks: int  # now
    ended: dict[str, int]  # HoldState value (freed / expired / aborted) -> holds that ended in it
    leases_expired: int
    reclaims: int  # holds ended or revoked early because their consumer agent went away (docs/lifecycle.md#reclaim)
    completions_failed: int  # consumers that reported a READ failed
    completions_aborted: int
    claims_confirmed: int
    claims_refused: int
    rejected_peers: int  # handshakes refused (bad fingerprint, missing or wrong proof, ...)
    rejected_messages: dict[str, int]  # notifications dropped by authentication, by cause
    malformed: int
    unknown_agent: int
    reports_ignored: int = 0  # reports not from the rank's confirmed reader (docs/lifecycle.md#who-reports)
    held_cap: int = 0  # max_held_blocks in effect: hold() refuses beyond it (docs/limits.md#held-blocks)
    notifications_dropped: int = 0  # arrived while the backlog of unhandled notifications was full (engine/inbox.py)
    notifications_fetched: int = 0  # handed over by NIXL's notification fetch
    notification_fetch: LatencySummary = msgspec.field(default_factory=LatencySummary)  # time inside NIXL's fetch
    handshake_evictions: int = 0  # accepted consumer agents forgotten before their Hello: the pending table was full
    handshakes_expired: int = 0  # ... because no Hello came within pending_handshake_s
    handshake_refusals: dict[str, int] = msgspec.field(default_factory=dict)  # refusals by wire.REFUSAL_CAUSES word
    oversized_messages: int = 0  # side-channel messages over the total cap across frames: dropped unread
    early_evicted: int = 0  # completions kept for a hold that had not happened, pushed out by the bound


class ConsumerRecorder:
    """What a consumer accumulates for its snapshot beyond its stats."""

    def __init__(self):
        self.latency = Histogram()
        self.bytes_needed = 0
        self.bytes_moved = 0
        self.byte_mismatches = 0
        self.descriptors = 0

    def on_done(self, needed: int, moved: int, descriptors: int, post_to_done_s: float) -> None:
        self.bytes_needed += needed
        self.bytes_moved += moved
        self.descriptors += descriptors
        self.latency.observe(post_to_done_s)


def consumer_metrics(consumer) -> ConsumerMetrics:
    s, r = consumer.stats, consumer._recorder
    return ConsumerMetrics(
        done=s.done, failed=s.failed, aborted=s.aborted, active=consumer.num_active,
        failures_by_cause=dict(consumer.failure_causes), bytes_needed=r.bytes_needed, bytes_moved=r.bytes_moved,
        byte_mismatches=r.byte_mismatches, descriptors=r.descriptors, reads_posted=s.reads_posted,
        post_to_done=r.latency.snapshot(), quarantined_blocks=consumer.num_quarantined_blocks,
        rejected_messages=dict(consumer.rejections.counts), unexpected_notifications=s.unexpected_notifications,
        claims_refused=s.claims_refused, revokes=s.revokes, links=consumer.num_links,
        link_failures=consumer.link_stats.failures, links_evicted=consumer.link_stats.evicted,
        notifications_dropped=s.notifications_dropped, transports=dict(Counter(consumer.link_transports().values())),
        reads_by_transport=dict(consumer.reads.reads), bytes_by_transport=dict(consumer.reads.bytes),
        **_fetch(consumer.agent))


def producer_metrics(producer) -> ProducerMetrics:
    s = producer.stats
    ended = Counter(producer.terminal_counts)
    listener = producer.listener_stats
    return ProducerMetrics(
        held_requests=producer.num_held_requests, pinned_blocks=producer.num_held_blocks, ended=dict(ended),
        leases_expired=ended.get("expired", 0), reclaims=s.reclaims, completions_failed=s.completions_failed,
        completions_aborted=s.completions_aborted, claims_confirmed=s.claims_confirmed,
        claims_refused=s.claims_refused, rejected_peers=listener.rejected,
        rejected_messages=dict(producer.rejections.counts), malformed=s.malformed, unknown_agent=s.unknown_agent,
        reports_ignored=s.not_reader, held_cap=producer.held_blocks_cap, **_producer_bounds(producer))


def _fetch(agent) -> dict:
    """NIXL's notification fetch, apart from the engine's own work (engine/agent.py ``get_notifs``)."""
    return dict(notifications_fetched=agent.num_fetched, notification_fetch=agent.fetch_time.snapshot())


def _producer_bounds(producer) -> dict:
    """What the producer's bounds dropped or refused (docs/limits.md), read from the tables that count it."""
    server = producer._server
    return dict(
        notifications_dropped=producer._inbox.num_dropped, handshake_evictions=producer._pending.num_evicted,
        handshakes_expired=producer._pending.num_expired, handshake_refusals=dict(producer.listener_stats.causes),
        oversized_messages=server.num_oversized if server is not None else 0,
        early_evicted=producer._early.stats.evicted, **_fetch(producer.agent))
