"""Percentiles, ratios and the per-variant summary, on hand-made timing records (no clocks)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.bench.stats import (
    ConsumerRun,
    PlanTiming,
    ProducerServe,
    RequestTiming,
    gbps,
    median,
    median_round,
    percentile,
    ratio,
    summarize,
)
from hybrid_transfer.errors import ConfigError


def test_percentile_interpolates_between_closest_ranks():
    values = [10.0, 20.0, 30.0, 40.0]
    assert percentile(values, 0) == 10.0
    assert percentile(values, 100) == 40.0
    assert percentile(values, 50) == 25.0
    assert percentile(values, 99) == pytest.approx(39.7)
    assert percentile([7.0], 99) == 7.0
    assert median([3.0, 1.0, 2.0]) == 2.0  # order of the input does not matter


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_matches_numpy_linear_method(values, q):
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("values, q", [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_rejects_no_values_and_bad_q(values, q):
    with pytest.raises(ConfigError):
        percentile(values, q)


def test_ratio_and_gbps():
    assert ratio(3.0, 4.0) == 0.75
    assert ratio(3.0, 0.0) is None
    assert ratio(None, 4.0) is None
    assert ratio(3.0, None) is None
    assert gbps(2_000_000_000, 0.5) == 4.0
    assert gbps(10, 0.0) == 0.0


def _t(rid, post, done, nbytes=1000, ndesc=10, notify=None, posted=None):
    return RequestTiming(rid, post, post + 0.001 if posted is None else posted,
                         done if notify is None else notify, done, nbytes, ndesc, 0.0001)


def test_summarize_spans_ranks_and_requests():
    # Two decode ranks, two requests each; rank 1 starts later and finishes last.
    runs = [
        ConsumerRun(0, (_t("a", 10.0, 10.2, ndesc=4), _t("b", 10.1, 10.3, ndesc=4)), cpu_s=0.5),
        ConsumerRun(1, (_t("a", 10.05, 10.4, ndesc=6), _t("b", 10.2, 10.6, ndesc=6)), cpu_s=0.7),
    ]
    serves = [ProducerServe(0, {"a": 10.45, "b": 10.61}, cpu_s=0.1, hold_s=(0.002, 0.004))]
    plans = [PlanTiming(0, (0.001, 0.003), (4, 4), (4, 4)), PlanTiming(1, (0.002, 0.002), (6, 6), (6, 6))]
    s = summarize("coalesced", runs, serves, plans)
    assert s.requests == 2
    assert s.payload_bytes == 4000
    assert s.window_s == pytest.approx(0.6)  # first post 10.0 -> last done 10.6
    assert s.gbps == pytest.approx(4000 / 0.6 / 1e9)
    assert s.descriptors_per_request == 10.0  # summed over ranks
    assert s.pieces_per_request == 10.0
    # Latency per (rank, request), post to DONE on that rank: 200, 200, 350 and 400 ms.
    assert s.p50_ms == pytest.approx(275.0)
    assert s.p99_ms == pytest.approx(350.0 + 50.0 * 0.97)
    # Lag: last free - last notify per request: a 10.45 - 10.4, b 10.61 - 10.6.
    assert s.notify_lag_p50_ms == pytest.approx(30.0)
    assert s.plan_ms == pytest.approx(2.0)
    assert s.hold_ms == pytest.approx(3.0)
    assert s.post_ms == pytest.approx(1.0)
    assert s.overhead_ms == pytest.approx(1.1)  # post + completion share 0.1 ms
    assert s.consumer_cpu_s == (0.5, 0.7) and s.producer_cpu_s == (0.1,)
    assert s.verified is False


def test_summarize_without_producers_has_no_lag_and_no_plan():
    s = summarize("ceiling", [ConsumerRun(0, (_t("a", 1.0, 1.5),), cpu_s=0.0)])
    assert s.notify_lag_p50_ms is None and s.plan_ms is None and s.hold_ms is None
    assert s.pieces_per_request is None


def test_summarize_skips_lag_of_requests_a_producer_never_freed():
    runs = [ConsumerRun(0, (_t("a", 1.0, 1.5), _t("b", 1.0, 1.6)), cpu_s=0.0)]
    serves = [ProducerServe(0, {"a": 1.7}, 0.0), ProducerServe(1, {"a": 1.8, "b": 1.9}, 0.0)]
    s = summarize("naive", runs, serves)
    assert s.notify_lag_p50_ms == pytest.approx(300.0) and s.notify_lag_p99_ms == pytest.approx(300.0)


def test_summarize_rejects_no_timings_and_ranks_that_disagree():
    with pytest.raises(ConfigError):
        summarize("naive", [ConsumerRun(0, (), 0.0)])
    runs = [ConsumerRun(0, (_t("a", 1.0, 2.0),), 0.0), ConsumerRun(1, (_t("b", 1.0, 2.0),), 0.0)]
    with pytest.raises(ConfigError):
        summarize("naive", runs)


def test_median_round_keeps_one_real_round_and_lists_all():
    rounds = []
    for i, window in enumerate([0.5, 0.25, 1.0]):  # 2, 4 and 1 GB/s... in that order
        t = RequestTiming(f"r{i}", 0.0, 0.001, window, window, 1_000_000_000, 3)
        rounds.append(summarize("naive", [ConsumerRun(0, (t,), cpu_s=float(i))]))
    chosen = median_round(rounds)
    assert chosen.gbps == 2.0 and chosen.consumer_cpu_s == (0.0,)  # round 0: its own figures, unmixed
    assert chosen.gbps_rounds == (2.0, 4.0, 1.0)
    assert median_round(rounds[:2]).gbps == 2.0  # even count: the lower middle
    with pytest.raises(ConfigError):
        median_round([])


def test_pack_figures_come_from_packed_requests_only():
    packed = RequestTiming("a", 0.0, 0.001, 0.5, 0.5, 100, 1, gather_s=0.004, query_s=0.001, scatter_s=0.002,
                           packed_sources=2)
    fallback = RequestTiming("b", 0.0, 0.001, 0.5, 0.5, 100, 9, fallback_sources=1)
    s = summarize("pack", [ConsumerRun(0, (packed, fallback), 0.0)])
    assert (s.gather_ms, s.query_ms, s.scatter_ms) == pytest.approx((4.0, 1.0, 2.0))
    assert (s.packed_sources, s.fallback_sources) == (2, 1)
    plain = summarize("coalesced", [ConsumerRun(0, (_t("c", 0.0, 1.0),), 0.0)])
    assert plain.gather_ms is None and plain.packed_sources == 0


def test_staged_sources_per_rank_and_round_show_autos_choice():
    """Issue 20: auto's mode per decode rank and round is in the figures (0: that rank read every source directly)."""
    def run(rank, staged):
        return ConsumerRun(rank, tuple(RequestTiming(f"q{k}", 0.0, 0.001, 0.5, 0.5, 100, 1, packed_sources=n)
                                       for k, n in enumerate(staged)), 0.0)

    rounds = [summarize("auto", [run(1, (1, 1)), run(0, (0, 0))]), summarize("auto", [run(0, (1, 1)), run(1, (1, 1))])]
    assert rounds[0].staged_per_rank == (0.0, 1.0)  # rank order, per request
    assert median_round(rounds).staged_rounds == ((0.0, 1.0), (1.0, 1.0))


def test_time_split_adds_up_to_each_requests_latency():
    # post 1 ms; READs seen done at 5 ms / 9 ms after the post; DONE at 6 / 12 ms (claims, scatter in between).
    a = RequestTiming("a", 1.0, 1.001, 1.006, 1.006, 100, 3, t_read_done=1.005)
    b = RequestTiming("b", 1.0, 1.001, 1.012, 1.012, 100, 3, t_read_done=1.009)
    for t in (a, b):
        assert t.read_s >= 0 and t.settle_s >= 0
        assert (t.t_posted - t.t_post) + t.read_s + t.settle_s == pytest.approx(t.t_done - t.t_post)
    assert (a.read_s, a.settle_s) == pytest.approx((0.004, 0.001))
    runs = [ConsumerRun(0, (a, b), cpu_s=0.004)]
    s = summarize("coalesced", runs, [ProducerServe(0, {"a": 1.007, "b": 1.013}, cpu_s=0.001),
                                      ProducerServe(1, {"a": 1.007, "b": 1.013}, cpu_s=0.003)])
    assert s.read_ms == pytest.approx(6.0) and s.settle_ms == pytest.approx(2.0)  # medians of (4, 8), (1, 3)
    assert s.read_ms <= s.p50_ms
    assert s.consumer_cpu_ms_per_request == pytest.approx(2.0)  # 4 ms over one rank's two requests
    assert s.producer_cpu_ms_per_request == pytest.approx(1.0)  # 4 ms over two ranks x two requests


def test_time_split_clamps_and_reports_unknown_reads_as_none():
    # A READ seen done before start_read returned (the copy ran inside the post) counts as 0 read time.
    early = RequestTiming("a", 1.0, 1.003, 1.004, 1.004, 100, 3, t_read_done=1.002)
    assert early.read_s == 0.0 and early.settle_s == pytest.approx(0.001)
    unknown = RequestTiming("b", 1.0, 1.001, 1.004, 1.004, 100, 3)
    assert unknown.read_s == 0.0
    s = summarize("coalesced", [ConsumerRun(0, (unknown,), cpu_s=0.0)])
    assert s.read_ms is None and s.settle_ms is None


def test_hook_time_is_per_rank_and_request_with_nixl_apart():
    """Issue 20: the worker-thread hooks (start_reads + collecting polls) per (decode rank, request), NIXL apart."""
    runs = [ConsumerRun(0, (_t("a", 1.0, 1.5), _t("b", 1.0, 1.6)), cpu_s=0.1, hook_s=0.004, hook_nixl_s=0.003,
                        steps=1),
            ConsumerRun(1, (_t("a", 1.0, 1.5), _t("b", 1.0, 1.6)), cpu_s=0.1, hook_s=0.002, hook_nixl_s=0.001,
                        steps=2)]
    s = summarize("coalesced", runs)
    assert s.hook_ms == pytest.approx(1.5) and s.hook_nixl_ms == pytest.approx(1.0)
    assert s.hook_python_ms == pytest.approx(0.5)
    assert s.requests_per_step == pytest.approx(4 / 3)


def test_runs_without_steps_have_no_hook_figures():
    s = summarize("ceiling", [ConsumerRun(0, (_t("a", 1.0, 1.5),), cpu_s=0.0)])
    assert (s.hook_ms, s.hook_nixl_ms, s.hook_python_ms, s.requests_per_step) == (None, None, None, None)
