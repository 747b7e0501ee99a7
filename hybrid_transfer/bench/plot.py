"""--plot: GB/s of the chosen mode, naive and the ceiling, against the swept value or as bars.

A token sweep adds what grows with the request: READ descriptors per decode rank and planning time
per request (three panels on one log-scaled token axis).
"""

from __future__ import annotations

from pathlib import Path

from hybrid_transfer.bench.coordinator import BenchResult
from hybrid_transfer.bench.report import headline
from hybrid_transfer.bench.spec import Sweep


def write_plot(result: BenchResult, path: str | Path) -> None:
    """A PNG (matplotlib, Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result.spec
    variants = list(result.points[0].stats)
    if s.sweep is Sweep.TOKENS:
        fig, axes = plt.subplots(3, 1, figsize=(7.5, 10), dpi=120, sharex=True)
        _token_panels(result, variants, axes)
        axes[0].set_title(headline(result), fontsize=7, loc="left")
    else:
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
        if s.sweep is Sweep.NONE:
            values = [result.points[0].stats[v].gbps for v in variants]
            bars = ax.bar(variants, values, color=["tab:blue", "tab:orange", "tab:green", "tab:red"][: len(variants)])
            ax.bar_label(bars, fmt="%.2f")
        else:
            xs = [p.point.fragmentation for p in result.points]
            for v in variants:
                ax.plot(xs, [p.stats[v].gbps for p in result.points], marker="o", label=v)
            ax.set_xlabel("fragmentation (0 contiguous, 1 shuffled)")
            ax.legend()
        ax.set_ylabel("effective GB/s")
        ax.set_ylim(bottom=0)
        ax.set_title(headline(result), fontsize=7, loc="left")
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _token_panels(result: BenchResult, variants: list[str], axes) -> None:
    """GB/s of every variant, descriptors per decode rank and plan ms per request, against tokens."""
    xs = [p.point.tokens for p in result.points]
    decode_tp = result.spec.decode_tp
    gbps_ax, desc_ax, plan_ax = axes
    for v in variants:
        stats = [p.stats[v] for p in result.points]
        gbps_ax.plot(xs, [st.gbps for st in stats], marker="o", label=v)
        desc_ax.plot(xs, [st.descriptors_per_request / decode_tp for st in stats], marker="o", label=v)
        if all(st.plan_ms is not None for st in stats):  # engine variants only: the ceiling has no plan
            plan_ax.plot(xs, [st.plan_ms for st in stats], marker="o", label=v)
    gbps_ax.set_ylabel("effective GB/s")
    gbps_ax.set_ylim(bottom=0)
    desc_ax.set_ylabel("READ descriptors per decode rank")
    if all(p.stats[v].descriptors_per_request > 0 for p in result.points for v in variants):
        desc_ax.set_yscale("log")
    plan_ax.set_ylabel("plan ms per request and rank")
    plan_ax.set_ylim(bottom=0)
    plan_ax.set_xlabel("tokens per request")
    for ax in axes:
        if min(xs) > 0:
            ax.set_xscale("log", base=2)
        else:  # a 0-token point (state only) has no place on a log axis
            ax.set_xscale("symlog", base=2, linthresh=max(1, min((x for x in xs if x > 0), default=1)))
        ax.set_xticks(xs, [f"{x:,}" for x in xs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
