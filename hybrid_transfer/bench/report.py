"""What a run reports: flat JSON records (one per point) and the terminal summary table."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from hybrid_transfer.bench import sizing, vllm_pool
from hybrid_transfer.bench.coordinator import BenchResult, PointResult
from hybrid_transfer.bench.spec import BenchSpec, Device, Point, Sweep, Variant
from hybrid_transfer.bench.stats import VariantStats, ratio

# Per-variant figures copied into the flat record, prefixed "naive_" / "ceiling_" / "copy_" for those three.
_FIGURES = ("gbps", "gbps_rounds", "descriptors_per_request", "pieces_per_request", "plan_ms", "post_ms",
            "completion_ms", "overhead_ms", "p50_ms", "p99_ms", "notify_lag_p50_ms", "notify_lag_p99_ms", "hold_ms",
            "consumer_cpu_s", "producer_cpu_s", "window_s", "gather_ms", "query_ms", "scatter_ms", "packed_sources",
            "fallback_sources", "read_ms", "settle_ms", "consumer_cpu_ms_per_request", "producer_cpu_ms_per_request",
            "hook_ms", "hook_nixl_ms", "hook_python_ms", "requests_per_step")


NOTE_WIDTH = 100  # the default summary's notes, wrapped (plain text)


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 6)
    if isinstance(x, (tuple, list)):
        return [_round(v) for v in x]
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    return x


def common_record(result: BenchResult) -> dict[str, Any]:
    s = result.spec
    record: dict[str, Any] = {
        "preset": s.preset, "prefill_tp": s.prefill_tp, "decode_tp": s.decode_tp, "requests": s.requests,
        "concurrency": s.concurrency, "device": s.device.value, "mode": s.mode.value,
        "kv_dtype": s.kv_dtype or "model", "kv_layout": s.kv_layout, "seed": s.seed, "warmup": s.warmup, "rounds": s.rounds,
        "backend_threads": s.backend_threads, "split_batch_size": s.split_batch_size, "post_thread": s.post_thread,
        "allocation": s.allocation, "per_step": s.step_size, "read_batching": s.read_batching,
    }
    if s.allocation == "vllm-pool":  # what the churn ran in (the largest point's pools; bench/vllm_pool.py)
        record["pool_blocks"] = [sizing.pool_blocks(s, True), sizing.pool_blocks(s, False)]
        record["live_requests"] = vllm_pool.LIVE_PER_TIMED * s.requests
    if s.device is Device.CUDA:
        record["prefill_gpus"] = list(s.prefill_gpus)
        record["decode_gpus"] = list(s.decode_gpus)
    return record


def point_record(result: BenchResult, point: PointResult) -> dict[str, Any]:
    """The flat JSON object of one point: the chosen mode's figures bare, naive_* and ceiling_* beside them."""
    s = result.spec
    chosen = point.stats[s.mode.value]
    naive = point.stats.get(Variant.NAIVE.value)  # absent in runs that time the mapped path (spec.variants)
    ceiling = point.stats[Variant.CEILING.value]
    copy = point.stats.get(Variant.COPY.value)
    record = common_record(result)
    record.update(tokens=point.point.tokens, fragmentation=point.point.fragmentation,
                  payload_bytes_per_request=point.payload_bytes_per_request)
    for name in _FIGURES:
        record[name] = getattr(chosen, name)
    for prefix, stats in (("naive_", naive), ("ceiling_", ceiling), ("copy_", copy)):
        if stats is None:
            continue
        for name in _FIGURES:
            record[prefix + name] = getattr(stats, name)
    record.update(
        mode_over_ceiling=ratio(chosen.gbps, ceiling.gbps),
        mode_over_naive=ratio(chosen.gbps, naive.gbps) if naive is not None else None,
        naive_over_ceiling=ratio(naive.gbps, ceiling.gbps) if naive is not None else None,
        ceiling_over_copy=ratio(ceiling.gbps, copy.gbps) if copy is not None else None,
        verified=all(st.verified for st in point.stats.values()),
        variants={name: dataclasses.asdict(st) for name, st in point.stats.items()},
    )
    return _round(record)


def to_json(result: BenchResult) -> dict[str, Any]:
    """One point: its flat record; a sweep: the common fields, ``sweep``, ``sweep_values`` and ``points``."""
    extra = {"host": result.host, "warnings": result.warnings,
             "memory_bytes": dataclasses.asdict(result.memory)}
    records = [point_record(result, p) for p in result.points]
    if result.spec.sweep is Sweep.NONE:
        return {**records[0], **extra}
    key = result.spec.sweep.value
    return {**common_record(result), "sweep": key, "sweep_values": [r[key] for r in records],
            "verified": all(r["verified"] for r in records), "points": records, **extra}


def headline(result: BenchResult) -> str:
    s = result.spec
    p = result.points[0].point
    shape = f"{s.preset}  P{s.prefill_tp} -> D{s.decode_tp}  {s.device.value}"
    if s.sweep is Sweep.NONE:
        mb = result.points[0].payload_bytes_per_request / 1e6
        return (f"{shape}  {p.tokens} tokens x {s.requests} requests ({mb:,.1f} MB each), mode {s.mode.value}\n"
                f"concurrency {s.concurrency}, {_steps(s)}, {_allocation(s, p)}")
    return (f"{shape}  sweep {s.sweep.value}, {s.requests} requests per point, mode {s.mode.value}\n"
            f"concurrency {s.concurrency}, {_steps(s)}")


def _steps(s: BenchSpec) -> str:
    return f"{s.step_size} per step ({s.read_batching})"


def _allocation(s: BenchSpec, p: Point) -> str:
    if s.allocation == "vllm-pool":
        return (f"vllm-pool ({sizing.pool_blocks(s, True):,} / {sizing.pool_blocks(s, False):,} blocks, "
                f"{vllm_pool.LIVE_PER_TIMED * s.requests} live)")
    return f"fragmentation {p.fragmentation}"


def _fmt(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _variants(result: BenchResult):
    """(first cells, variant name, its stats, ceiling GB/s, naive GB/s) per (point, variant), in table order.

    The first cells are the sweep value (when sweeping) and the variant's label (``*`` on the chosen mode).
    """
    s = result.spec
    for pr in result.points:
        ceiling = pr.stats[Variant.CEILING.value].gbps
        naive = pr.stats[Variant.NAIVE.value].gbps if Variant.NAIVE.value in pr.stats else None
        for name, st in pr.stats.items():
            first = [str(getattr(pr.point, s.sweep.value))] if s.sweep is not Sweep.NONE else []
            yield first + [name + ("*" if name == s.mode.value else "")], name, st, ceiling, naive


def table_rows(result: BenchResult) -> list[list[str]]:
    """Rows of the summary table (strings), one per (point, variant)."""
    rows = []
    for row, name, st, ceiling, naive in _variants(result):
        row += [
            _fmt(st.gbps) + (f" ({min(st.gbps_rounds):.2f}-{max(st.gbps_rounds):.2f})"
                             if len(st.gbps_rounds) > 1 else ""),
            _fmt(ratio(st.gbps, ceiling)),
            "-" if name in (Variant.CEILING.value, Variant.COPY.value) else _fmt(ratio(st.gbps, naive)),
            _fmt(st.descriptors_per_request, 1), _fmt(st.plan_ms, 3), _fmt(st.post_ms, 3),
            _fmt(st.overhead_ms, 3), _fmt(st.hook_ms, 3), _fmt(st.hook_nixl_ms, 3), _fmt(st.hook_python_ms, 3),
            _fmt(st.p50_ms), _fmt(st.p99_ms), _fmt(st.notify_lag_p50_ms, 3), _fmt(st.hold_ms, 3),
            "-" if st.gather_ms is None else f"{st.gather_ms:.3f} / {st.scatter_ms:.3f}",
            f"{sum(st.consumer_cpu_s):.2f} / {sum(st.producer_cpu_s):.2f}",
            "yes" if st.verified else "no",
        ]
        rows.append(row)
    return rows


COLUMNS = ("variant", "GB/s", "/ceiling", "/naive", "desc/req", "plan ms", "post ms", "ovh ms", "hook ms", "nixl ms",
           "py ms", "p50 ms", "p99 ms", "lag ms", "hold ms", "gather/scatter ms", "CPU s d/p", "verified")
HOOK_NOTE = (
    "hook ms: the decode rank's worker-thread wall time per request in the engine's hooks (the start_reads "
    "calls, --per-step requests each, and the polls that collected results; not the empty polls between "
    "steps), nixl ms: NIXL's own calls in it, py ms: the rest (our Python)."
)
NOTES = (
    "*: the chosen --mode. GB/s: valid payload bytes of all decode ranks / (first post -> last request DONE), "
    "bytes in their final place, the same count for every variant (naive moves whole pages; their unused tails "
    "are not counted); with --rounds, every figure is the median round's and (min-max) the rounds' GB/s. "
    "desc/req: READ descriptors planned per request, all decode ranks (posted as planned: NIXL's direct path "
    "does not merge). plan ms: median planner time per request and rank, measured again outside the window. "
    "post ms: median time inside the start_reads call that started the request (its whole step: plan, "
    "validation, post; on CPU, UCX may copy inside the post). "
    "ovh ms: post + the share of the poll that saw DONE (per-request CPU overhead). " + HOOK_NOTE + " p50/p99 ms: request "
    "latency, post -> DONE on each decode rank. lag ms: consumer notify -> producer free (median). hold ms: "
    "producer hold per request. gather/scatter ms: pack only, the producer's gather (done at hold, off the "
    "critical path; asynchronous on GPU, so not inside hold ms there) and the consumer's scatter (inside the "
    "window). CPU s d/p: process CPU seconds in the window, decode ranks / prefill ranks. ceiling: one READ per "
    "(decode rank, source) of the same bytes as a single descriptor, same processes. copy: the physical "
    "limit, one torch copy per (decode rank, source) of the same bytes, no NIXL (from the source's device)."
)


SPLIT_COLUMNS = ("variant", "plan ms", "post ms", "read ms", "settle ms", "query ms", "scatter ms", "p50 ms",
                 "ovh ms", "CPU ms/req d/p")
SPLIT_TITLE = "time split per request and decode rank (medians)"
SPLIT_NOTES = (
    "Per (decode rank, request): post ms (inside start_read) + read ms (start_read returned -> every READ "
    "DONE; pack: the wait for the Staged notification included) + settle ms (READs DONE -> reported DONE: "
    "pack's scatter, the producers' claim confirmations) = that request's latency; each column is a median, "
    "so they add up per request, not across columns. plan ms: measured again outside the window (it is inside "
    "post ms). query / scatter ms: pack only. CPU ms/req: process CPU time in the window per (rank, request), "
    "decode ranks / prefill ranks."
)


def split_rows(result: BenchResult) -> list[list[str]]:
    """Rows of the time-split table, one per (point, variant)."""
    s = result.spec
    rows = []
    for pr in result.points:
        for name, st in pr.stats.items():
            row = [str(getattr(pr.point, s.sweep.value))] if s.sweep is not Sweep.NONE else []
            row += [
                name + ("*" if name == s.mode.value else ""), _fmt(st.plan_ms, 3), _fmt(st.post_ms, 3),
                _fmt(st.read_ms, 3), _fmt(st.settle_ms, 3), _fmt(st.query_ms, 3), _fmt(st.scatter_ms, 3),
                _fmt(st.p50_ms, 3), _fmt(st.overhead_ms, 3),
                f"{st.consumer_cpu_ms_per_request:.3f} / {st.producer_cpu_ms_per_request:.3f}",
            ]
            rows.append(row)
    return rows


COMPACT_COLUMNS = ("variant", "GB/s", "rounds", "/ceil", "/naive", "desc", "hook", "nixl", "py", "p50", "ok")
COMPACT_LEAD = {"fragmentation": "frag", "tokens": "tokens"}  # the swept value's header
COMPACT_NOTES = (
    "*: the chosen --mode. GB/s: valid payload bytes / (first post -> last DONE), the median round's; rounds: "
    "the rounds' min-max. /ceil, /naive: GB/s over the ceiling's (one READ per source) and naive's (vLLM's "
    "scheme). desc: READ descriptors per request. In ms: " + HOOK_NOTE.replace(" ms:", ":") + " p50: post "
    "-> DONE, median. ok: bytes verified. --wide: every column and the time split (docs/benchmarks.md#reading-the-table)."
)


def compact_rows(result: BenchResult) -> list[list[str]]:
    """Rows of the default summary (COMPACT_COLUMNS), one per (point, variant): fits 100 columns."""
    rows = []
    for row, name, st, ceiling, naive in _variants(result):
        limit = name in (Variant.CEILING.value, Variant.COPY.value)
        row += [
            _num(st.gbps),
            f"{_short(min(st.gbps_rounds))}-{_short(max(st.gbps_rounds))}" if len(st.gbps_rounds) > 1 else "-",
            _fmt(ratio(st.gbps, ceiling)), "-" if limit else _fmt(ratio(st.gbps, naive)),
            _compact_count(st.descriptors_per_request), _num(st.hook_ms, 3), _num(st.hook_nixl_ms, 3),
            _num(st.hook_python_ms, 3), _num(st.p50_ms), "yes" if st.verified else "no",
        ]
        rows.append(row)
    return rows


def _num(x: float | None, digits: int = 2) -> str:
    """Like _fmt, with fewer decimals as the value grows (the default summary's cells stay narrow)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}" if x >= 100 else f"{x:.{digits}f}"


def _short(x: float) -> str:
    """Three significant figures or more, no separators: a rounds range stays narrow."""
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _compact_count(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def advice_lines(result: BenchResult) -> list[str]:
    """Lines that say what a figure cannot show: one round is one window on a possibly busy host."""
    if result.spec.rounds == 1:
        return ["one round: each figure is a single window, which a busy host can move by a third; "
                "use --rounds 3 (or more) before comparing variants"]
    return []


def staged_lines(result: BenchResult) -> list[str]:
    """Per point, for auto and pack: each round's staged source reads per request on every decode rank (auto's
    choice per rank and round: 0 is direct; docs/planner.md#auto)."""
    s, lines = result.spec, []
    for pr in result.points:
        where = f" at {s.sweep.value} {getattr(pr.point, s.sweep.value)}" if s.sweep is not Sweep.NONE else ""
        for name in ("auto", "pack", Variant.MAPPED_AUTO.value):
            st = pr.stats.get(name)
            if st is not None and st.staged_rounds:
                per_round = " | ".join(f"r{i}: " + " ".join(f"{x:g}" for x in r) for i, r in enumerate(st.staged_rounds))
                lines.append(f"{name}{where}: staged sources per request by decode rank: {per_round}")
        for name, transport in (("auto", "nixl"), (Variant.MAPPED_AUTO.value, "mapped")):
            st = pr.stats.get(name)
            if st is not None:
                lines.append(f"{name}{where}: {auto_reason(s, st, pr.payload_bytes_per_request, transport)}")
    return lines


def auto_reason(s: BenchSpec, st: VariantStats, payload_bytes: int, transport: str) -> str:
    """Why auto chose as it did, from the cost preset of the transport it read over (docs/planner.md#auto-across-transports).

    An estimate per decode rank: the request's direct descriptors (all decode ranks' over their number) and
    payload, priced by the preset's direct and pack terms (one staged piece per source); the planner decides
    per source with the same terms.
    """
    from hybrid_transfer.plan.cost import preset_for

    cost = preset_for(s.device is Device.CUDA, transport)
    desc = st.descriptors_per_request / s.decode_tp
    nbytes = payload_bytes / s.decode_tp
    direct, pack = cost.direct_s(round(desc), round(nbytes)), cost.pack_s(1, round(nbytes))
    chose = "pack" if pack < direct else "direct"
    return (f"over {transport}, the cost preset ({cost.per_descriptor_s * 1e6:g} us per descriptor, "
            f"{1 / cost.per_byte_s / 1e9:,.0f} GB/s, pack's fixed {cost.pack_fixed_s * 1e3:g} ms) prices a decode rank's "
            f"request at {direct * 1e3:.3f} ms direct ({desc:.0f} descriptors) against {pack * 1e3:.3f} ms packed: "
            f"{chose} expected (staged sources above: what it chose)")


def _plain(header: list[str], rows: list[list[str]]) -> list[str]:
    rows = [header] + rows
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = []
    for n, row in enumerate(rows):
        lines.append("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths,
                                                                                            strict=True))))
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return lines


def plain_table(result: BenchResult, wide: bool = False) -> str:
    """The summary as plain text (where rich is not installed, e.g. a bare GPU image): the 100-column one, or
    with ``wide`` every column and the time-split table."""
    lead = [result.spec.sweep.value] if result.spec.sweep is not Sweep.NONE else []
    lines = headline(result).splitlines() + [""]
    if not wide:
        lines += _plain([COMPACT_LEAD[x] for x in lead] + list(COMPACT_COLUMNS), compact_rows(result))
        lines += [""] + textwrap.wrap(COMPACT_NOTES, NOTE_WIDTH)
    else:
        lines += _plain(lead + list(COLUMNS), table_rows(result))
        lines += ["", NOTES, "", SPLIT_TITLE, ""] + _plain(lead + list(SPLIT_COLUMNS), split_rows(result))
        lines += ["", SPLIT_NOTES]
    tail = staged_lines(result) + advice_lines(result) + [f"warning: {w}" for w in result.warnings]
    lines += tail if wide else [w for line in tail for w in textwrap.wrap(line, NOTE_WIDTH)]
    return "\n".join(lines)


def print_table(result: BenchResult, console, wide: bool = False) -> None:
    """The rich summary on ``console``: the 100-column one, or with ``wide`` every column and the time split."""
    if not wide:
        console.print(headline(result))  # above the table, not its title: a title wraps at the table's width
        console.print(_rich_table(result, None, COMPACT_COLUMNS, compact_rows(result), compact=True))
        console.print("\n".join(textwrap.wrap(COMPACT_NOTES, NOTE_WIDTH)), style="dim")
    else:
        console.print(_rich_table(result, headline(result), COLUMNS, table_rows(result)))
        console.print(NOTES, style="dim")
        console.print(_rich_table(result, SPLIT_TITLE, SPLIT_COLUMNS, split_rows(result)))
        console.print(SPLIT_NOTES, style="dim")
    def lines(text: str) -> str:  # the default summary's lines stay within NOTE_WIDTH on a wide terminal too
        return text if wide else "\n".join(textwrap.wrap(text, NOTE_WIDTH))

    for line in staged_lines(result) + advice_lines(result):
        console.print(lines(line))
    for w in result.warnings:
        console.print(lines(f"warning: {w}"), style="yellow")


def _rich_table(result: BenchResult, title: str | None, columns, rows, compact: bool = False):
    """One rich table: the swept value first (when there is a sweep), then ``columns``; ``compact``: no
    vertical rules (the default summary must fit 100 columns)."""
    from rich import box
    from rich.table import Table

    table = Table(title=title, title_justify="left", box=None if compact else box.HEAVY_HEAD,
                  pad_edge=not compact, show_edge=not compact)
    if result.spec.sweep is not Sweep.NONE:
        sweep = result.spec.sweep.value
        table.add_column(COMPACT_LEAD[sweep] if compact else sweep, justify="right")
    for i, col in enumerate(columns):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def stats_of(result: BenchResult, variant: str) -> list[VariantStats]:
    """One variant's figures at every point, in point order."""
    return [p.stats[variant] for p in result.points]
