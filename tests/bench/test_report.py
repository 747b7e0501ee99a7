"""JSON records, table rows and the plot, from a hand-made result (no processes)."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest

from hybrid_transfer.bench.coordinator import BenchResult, PointResult
from hybrid_transfer.bench.plot import write_plot
from hybrid_transfer.bench.report import (
    COLUMNS,
    COMPACT_COLUMNS,
    SPLIT_COLUMNS,
    SPLIT_TITLE,
    compact_rows,
    plain_table,
    point_record,
    print_table,
    split_rows,
    table_rows,
    to_json,
)
from hybrid_transfer.bench.sizing import MemoryEstimate
from hybrid_transfer.bench.spec import BenchSpec, Point, Sweep
from hybrid_transfer.bench.stats import VariantStats
from hybrid_transfer.plan.types import PlanMode

REQUIRED = ("preset", "prefill_tp", "decode_tp", "tokens", "requests", "device", "mode", "gbps", "naive_gbps",
            "ceiling_gbps", "descriptors_per_request", "naive_descriptors_per_request", "p50_ms", "p99_ms",
            "verified")


def _stats(variant: str, gbps: float, descriptors: float, verified: bool = True) -> VariantStats:
    return VariantStats(variant=variant, requests=4, payload_bytes=4000, window_s=1.0, gbps=gbps,
                        descriptors_per_request=descriptors, pieces_per_request=None, plan_ms=0.1, post_ms=0.2,
                        completion_ms=0.01, overhead_ms=0.21, p50_ms=1.0, p99_ms=2.0, notify_lag_p50_ms=0.3, notify_lag_p99_ms=0.4,
                        hold_ms=0.05, consumer_cpu_s=(0.5,), producer_cpu_s=(0.1,), verified=verified)


def _result(spec: BenchSpec, points: list[Point], verified: bool = True) -> BenchResult:
    chosen = spec.mode.value
    out = []
    for i, p in enumerate(points):
        stats = {chosen: _stats(chosen, 4.0 + i, 40.0, verified), "naive": _stats("naive", 2.0, 130.0),
                 "ceiling": _stats("ceiling", 5.0, 1.0), "copy": _stats("copy", 10.0, 1.0)}
        out.append(PointResult(p, 1000, stats))
    return BenchResult(spec, out, MemoryEstimate(1, 2, 3), {"cpu_count": 2})


def test_point_record_has_the_required_keys_and_ratios():
    spec = BenchSpec(verify=True)
    record = point_record(_result(spec, [Point(2048, 0.0)]), _result(spec, [Point(2048, 0.0)]).points[0])
    assert set(REQUIRED) <= record.keys()
    assert record["gbps"] == 4.0 and record["naive_gbps"] == 2.0 and record["ceiling_gbps"] == 5.0
    assert record["mode_over_ceiling"] == pytest.approx(0.8) and record["mode_over_naive"] == pytest.approx(2.0)
    assert record["descriptors_per_request"] == 40.0 and record["naive_descriptors_per_request"] == 130.0
    assert record["verified"] is True
    assert set(record["variants"]) == {"coalesced", "naive", "ceiling", "copy"}
    assert record["copy_gbps"] == 10.0 and record["ceiling_over_copy"] == pytest.approx(0.5)
    json.dumps(record)  # plain JSON types only


def test_verified_is_false_when_any_variant_was_not_checked():
    spec = BenchSpec()
    result = _result(spec, [Point(2048, 0.0)], verified=False)
    assert to_json(result)["verified"] is False


def test_naive_as_the_chosen_mode_reports_itself_as_naive():
    spec = BenchSpec(mode=PlanMode.NAIVE)
    r = _result(spec, [Point(64, 0.0)])
    r.points[0].stats.pop("naive")  # the chosen mode *is* naive: one "naive" entry
    r.points[0].stats["naive"] = _stats("naive", 2.0, 130.0)
    record = to_json(r)
    assert record["gbps"] == record["naive_gbps"] and record["mode_over_naive"] == 1.0


def test_sweep_json_lists_points_in_order():
    spec = BenchSpec(sweep=Sweep.FRAGMENTATION, sweep_values=(0.0, 1.0))
    doc = to_json(_result(spec, list(spec.points)))
    assert doc["sweep"] == "fragmentation" and doc["sweep_values"] == [0.0, 1.0]
    assert [p["gbps"] for p in doc["points"]] == [4.0, 5.0]
    assert all(set(REQUIRED) <= p.keys() for p in doc["points"])


def test_table_has_one_row_per_variant_and_point():
    spec = BenchSpec(sweep=Sweep.TOKENS, sweep_values=(64.0, 128.0))
    rows = table_rows(_result(spec, list(spec.points)))
    assert len(rows) == 8 and all(len(r) == len(COLUMNS) + 1 for r in rows)
    assert rows[0][:3] == ["64", "coalesced*", "4.00"]
    assert rows[2][4] == "-" and rows[3][4] == "-"  # the ceiling and the copy have no "vs naive"
    assert rows[3][1:4] == ["copy", "10.00", "2.00"]  # the physical limit, as a multiple of the ceiling


def test_plain_table_without_rich_shows_the_same_rows():
    spec = BenchSpec()
    result = _result(spec, [Point(2048, 0.0)])
    lines = plain_table(result, wide=True).splitlines()
    assert lines[0].startswith("qwen3.5-0.8b  P1 -> D1  cpu  2048 tokens")
    assert lines[1].startswith("concurrency 4, 4 per step (per_step)")
    assert lines[3].split() == [c for col in COLUMNS for c in col.split()]
    assert [line.split()[0] for line in lines[5:9]] == ["coalesced*", "naive", "ceiling", "copy"]


@pytest.mark.parametrize("sweep", [Sweep.NONE, Sweep.TOKENS])
def test_plot_writes_a_png(tmp_path, sweep):
    spec = BenchSpec(sweep=sweep, sweep_values=(64.0, 128.0) if sweep is Sweep.TOKENS else ())
    path = tmp_path / "plot.png"
    write_plot(_result(spec, list(spec.points)), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_time_split_table_and_json_carry_the_split_per_variant():
    spec = BenchSpec(sweep=Sweep.TOKENS, sweep_values=(64.0, 128.0))
    result = _result(spec, list(spec.points))
    for p in result.points:  # the chosen mode reads in 0.5 ms and settles in 0.3 ms; the others never said
        st = p.stats["coalesced"]
        p.stats["coalesced"] = dataclasses.replace(st, read_ms=0.5, settle_ms=0.3, consumer_cpu_ms_per_request=0.7,
                                                   producer_cpu_ms_per_request=0.1)
    rows = split_rows(result)
    assert len(rows) == 8 and all(len(r) == len(SPLIT_COLUMNS) + 1 for r in rows)
    assert rows[0][:6] == ["64", "coalesced*", "0.100", "0.200", "0.500", "0.300"]
    assert rows[0][-1] == "0.700 / 0.100" and rows[1][4] == "-"
    text = plain_table(result, wide=True)
    assert SPLIT_TITLE in text and "read ms" in text and "settle ms" in text
    assert SPLIT_TITLE not in plain_table(result)  # the default summary leaves the split to --wide
    point = to_json(result)["points"][0]
    assert (point["read_ms"], point["settle_ms"]) == (0.5, 0.3)
    assert point["consumer_cpu_ms_per_request"] == 0.7 and point["naive_read_ms"] is None


def test_auto_runs_print_each_rounds_staged_sources_per_decode_rank():
    """Issue 20: the text output names auto's choice per decode rank and round (0: read directly)."""
    spec = BenchSpec(mode=PlanMode.AUTO)
    result = _result(spec, [Point(2048, 0.0)])
    auto = dataclasses.replace(result.points[0].stats["auto"], staged_rounds=((1.0, 1.0), (0.0, 1.0)))
    result.points[0].stats["auto"] = auto
    lines = [line for line in plain_table(result).splitlines() if "staged sources" in line]
    assert lines == ["auto: staged sources per request by decode rank: r0: 1 1 | r1: 0 1"]


def _typical(spec: BenchSpec) -> BenchResult:
    """A long-context P2 -> D8 run's figures: thousands of descriptors, second-long latencies, 3 rounds."""
    def figures(variant, gbps, descriptors, engine=True):
        return dataclasses.replace(
            _stats(variant, gbps, descriptors), p50_ms=1234.5, p99_ms=2345.6, post_ms=38.123, plan_ms=2.2,
            gbps_rounds=(gbps * 0.9, gbps, gbps * 1.1), consumer_cpu_s=(0.5,) * 8, producer_cpu_s=(0.1, 0.2),
            hook_ms=12.345 if engine else None, hook_nixl_ms=10.123 if engine else None,
            hook_python_ms=2.222 if engine else None, requests_per_step=16.0 if engine else None)
    points = []
    for p in spec.points:
        stats = {spec.mode.value: figures(spec.mode.value, 123.45, 38160.0), "coalesced": figures("coalesced", 23.4,
                 38160.0), "naive": figures("naive", 12.3, 100000.0), "ceiling": figures("ceiling", 234.56, 8.0, False),
                 "copy": figures("copy", 1234.5, 8.0, False)}
        points.append(PointResult(p, 10**9, stats))
    return BenchResult(spec, points, MemoryEstimate(1, 2, 3), {"cpu_count": 2},
                       ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY was unset: set to y for the rank processes (docs/tuning.md)"])


_TYPICAL_SPECS = [
    BenchSpec(preset="qwen3.5-397b-a17b", prefill_tp=2, decode_tp=8, tokens=131072, mode=PlanMode.AUTO,
              concurrency=16, rounds=3, fragmentation=1.0),
    BenchSpec(preset="qwen3.5-397b-a17b", mode=PlanMode.PACK, sweep=Sweep.FRAGMENTATION, sweep_values=(0.0, 0.25),
              rounds=3),
    BenchSpec(mode=PlanMode.AUTO, sweep=Sweep.TOKENS, sweep_values=(8192.0, 131072.0), rounds=1, concurrency=16,
              per_step=4, read_batching="per_request"),
]


@pytest.mark.parametrize("spec", _TYPICAL_SPECS, ids=["p2d8-131k-auto", "frag-sweep-pack", "token-sweep-1-round"])
def test_default_summary_fits_100_columns(spec):
    """Issue 21 item 2: the default table fits 100 columns, plain and rich (a pipe's width is 100)."""
    from rich.console import Console

    result = _typical(spec)
    plain = plain_table(result).splitlines()
    assert max(len(line) for line in plain) <= 100, max(plain, key=len)
    header = next(line for line in plain if line.split()[-2:] == ["p50", "ok"])
    assert "hook" in header.split() and "nixl" in header.split() and "py" in header.split()
    buffer = io.StringIO()
    print_table(result, Console(file=buffer, width=200))  # wider than needed: nothing is squeezed to fit
    rendered = buffer.getvalue().splitlines()
    assert max(len(line.rstrip()) for line in rendered) <= 100, max(rendered, key=len)
    assert "…" not in buffer.getvalue()  # no cell was cut
    assert all(name in buffer.getvalue() for name in ("coalesced", "naive", "ceiling", "12.345", "10.123", "2.222"))


def test_wide_shows_every_column_and_the_time_split():
    from rich.console import Console

    result = _typical(_TYPICAL_SPECS[0])
    plain = plain_table(result, wide=True)
    header = next(line for line in plain.splitlines() if line.startswith("variant"))
    assert header.split() == [c for col in COLUMNS for c in col.split()]
    assert SPLIT_TITLE in plain
    buffer = io.StringIO()
    print_table(result, Console(file=buffer, width=250), wide=True)
    assert all(col in buffer.getvalue() for col in (*COLUMNS, *SPLIT_COLUMNS)) and SPLIT_TITLE in buffer.getvalue()


def test_compact_rows_carry_the_hook_figures_and_the_rounds_range():
    rows = compact_rows(_typical(_TYPICAL_SPECS[0]))
    assert all(len(r) == len(COMPACT_COLUMNS) for r in rows)
    assert rows[0] == ["auto*", "123.5", "111-136", "0.53", "10.04", "38,160", "12.345", "10.123", "2.222", "1,234",
                       "yes"]
    assert rows[3][6:9] == ["-", "-", "-"]  # the ceiling has no engine hooks


def test_one_round_names_rounds_and_three_do_not():
    one = plain_table(_typical(_TYPICAL_SPECS[2]))
    assert "--rounds" in one and "one round" in one
    assert "one round" not in plain_table(_typical(_TYPICAL_SPECS[0]))


def test_json_carries_the_hook_figures_and_the_step():
    spec = BenchSpec(concurrency=16, per_step=4, read_batching="per_request")
    record = to_json(_typical(spec))
    assert (record["per_step"], record["read_batching"]) == (4, "per_request")
    assert (record["hook_ms"], record["hook_nixl_ms"], record["hook_python_ms"]) == (12.345, 10.123, 2.222)
    assert record["requests_per_step"] == 16.0 and record["ceiling_hook_ms"] is None
