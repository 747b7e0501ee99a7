"""Export metrics snapshots (engine/metrics.py) through ``prometheus_client``, when it is installed.

A collector that takes a fresh snapshot at each scrape: integer fields become gauges (counters
since start keep their meaning: a restart starts them at 0), dict fields one family with a label
for the key, and the post-to-DONE latency a histogram. Nothing here is imported by the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import msgspec

from hybrid_transfer.engine.metrics import ConsumerMetrics, LatencySummary, ProducerMetrics
from hybrid_transfer.errors import ConfigError

Source = Callable[[], ProducerMetrics | ConsumerMetrics]


class MetricsCollector:
    """A prometheus_client collector for one rank: ``side`` (producer / consumer) and ``rank`` become labels."""

    def __init__(self, source: Source, *, side: str, rank: int | str = 0, prefix: str = "hybrid_transfer"):
        if side not in ("producer", "consumer"):
            raise ConfigError(f"side {side!r} must be 'producer' or 'consumer'", field="side", value=side)
        self.source, self.side, self.rank, self.prefix = source, side, str(rank), prefix

    def collect(self) -> Iterator:
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        snapshot = self.source()
        base = f"{self.prefix}_{self.side}"
        labels, values = ["rank"], [self.rank]
        for name, value in msgspec.structs.asdict(snapshot).items():
            if isinstance(value, bool):
                continue
            if isinstance(value, int):
                family = GaugeMetricFamily(f"{base}_{name}", f"{self.side} {name}", labels=labels)
                family.add_metric(values, value)
                yield family
            elif isinstance(value, dict):
                family = GaugeMetricFamily(f"{base}_{name}", f"{self.side} {name} by key", labels=[*labels, "key"])
                for key, n in sorted(value.items()):
                    family.add_metric([*values, str(key)], n)
                yield family
            elif isinstance(value, LatencySummary):
                yield _histogram(HistogramMetricFamily, f"{base}_{name}_seconds", value, labels, values)

    def describe(self) -> list:
        return []  # described at collect time (the dict keys are known only then)


def _histogram(cls, name: str, summary: LatencySummary, labels, values):
    family = cls(name, "first READ posted to DONE", labels=labels)
    buckets, seen = [], 0
    for bound, n in zip(summary.bounds_s, summary.counts, strict=False):
        seen += n
        buckets.append((repr(bound), seen))
    buckets.append(("+Inf", summary.count))
    family.add_metric(values, buckets, summary.sum_s)
    return family


def register(source: Source, *, side: str, rank: int | str = 0, registry=None) -> MetricsCollector:
    """Register a collector for ``source`` (e.g. ``producer.metrics``) with ``registry`` (default: the global one).

    Raises:
        ConfigError: prometheus_client is not installed, or ``side`` is not producer / consumer.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError as exc:
        raise ConfigError("exporting metrics needs prometheus_client (pip install prometheus_client)",
                          field="prometheus_client") from exc
    collector = MetricsCollector(source, side=side, rank=rank)
    (registry if registry is not None else REGISTRY).register(collector)
    return collector
