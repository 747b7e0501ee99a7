"""--plot: GB/s of the chosen mode, naive and the ceiling, against the swept value or as bars."""

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
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    if s.sweep is Sweep.NONE:
        values = [result.points[0].stats[v].gbps for v in variants]
        bars = ax.bar(variants, values, color=["tab:blue", "tab:orange", "tab:green"][: len(variants)])
        ax.bar_label(bars, fmt="%.2f")
    else:
        xs = [getattr(p.point, s.sweep.value) for p in result.points]
        for v in variants:
            ax.plot(xs, [p.stats[v].gbps for p in result.points], marker="o", label=v)
        ax.set_xlabel("fragmentation (0 contiguous, 1 shuffled)" if s.sweep is Sweep.FRAGMENTATION
                      else "tokens per request")
        ax.legend()
    ax.set_ylabel("effective GB/s")
    ax.set_ylim(bottom=0)
    ax.set_title(headline(result), fontsize=7, loc="left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
