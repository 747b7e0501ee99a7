"""The connector's transfers through vLLM's own stats path: the periodic log line and ``/metrics`` (issue 26).

Each worker rank tallies what it sees (``ReadTally``: one entry per finished read, never per
descriptor) and vLLM takes it after every step (``get_kv_connector_stats``). The object then
crosses to the engine core pickled, is merged there across TP ranks (vLLM's ``KVOutputAggregator``),
and only its ``data`` goes on, msgpack-encoded inside ``SchedulerStats``, to the front end. There
vLLM rebuilds it (``build_kv_connector_stats``) to accumulate one log interval, and hands the
same dict to the Prometheus metrics (``build_prom_metrics``). So ``data`` holds only ints, floats,
lists and str-keyed dicts, and a key an older sender lacks counts as zero. vLLM 0.32 and 0.33 share
this interface; 0.32 logs a line even when ``reduce()`` is empty, so ``reduce()`` is never empty
unless ``is_empty()``. docs/metrics.md#vllm lists what shows where.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from hybrid_transfer.engine.lifecycle.state import FailureCause, ReadResult, ReadState
from hybrid_transfer.engine.metrics import LATENCY_BOUNDS_S

# Summed over ranks and steps. reads_refused / loads_failed: WorkerSide.counts (refused before any byte
# moved; the scheduler's fail orders); holds_expired: producer holds whose lease ran out.
# blocks_read: attention blocks DONE reads wrote (over every attention group). hit_reads / hit_tokens /
# hit_blocks / hit_bytes: DONE reads that started past a local prefix hit, and what the hits saved (tokens,
# attention blocks and bytes not moved; docs/vllm.md#prefix-caching).
COUNTERS = ("reads_done", "reads_failed", "reads_aborted", "reads_refused", "loads_failed", "bytes_read",
            "descriptors", "holds_expired", "blocks_read", "hit_reads", "hit_tokens", "hit_blocks", "hit_bytes")
SAMPLES = ("post_s", "transfer_s")  # one value per DONE read, seconds
CAUSES = "failure_causes"  # FailureCause value -> FAILED reads, summed
LATEST = ("held_blocks", "held_requests")  # producer TP rank (str) -> its value now; a later report replaces it
_PRODUCER_KEYS = ("holds_expired", *LATEST)


def _normalized(data: dict[str, Any] | None) -> dict[str, Any]:
    """A fresh, complete ``data`` dict: vLLM may alias the dict it passes in, and a missing key is zero."""
    data = data or {}
    out: dict[str, Any] = {key: int(data.get(key, 0)) for key in COUNTERS}
    out.update({key: [float(v) for v in data.get(key, ())] for key in SAMPLES})
    for key in (CAUSES, *LATEST):
        out[key] = {str(k): int(v) for k, v in (data.get(key) or {}).items()}
    return out


@dataclass(frozen=True)
class Hit:
    """What one read's local prefix hit saved on its rank (all 0 without a hit)."""

    tokens: int
    blocks: int  # attention blocks, over every attention group
    bytes: int
    blocks_read: int = 0  # attention blocks the read wrote, over every attention group


@dataclass
class HybridKVConnectorStats(KVConnectorStats):
    """One rank's (or, merged, an engine's) transfers over one step or one log interval."""

    def __post_init__(self):
        self.data = _normalized(self.data)

    def reset(self) -> None:
        self.data = _normalized(None)

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        """Fold ``other`` (another rank of the same step, or a later step) into this one; returns self."""
        mine, theirs = self.data, _normalized(other.data)
        for key in COUNTERS:
            mine[key] += theirs[key]
        for key in SAMPLES:
            mine[key].extend(theirs[key])
        for cause, n in theirs[CAUSES].items():
            mine[CAUSES][cause] = mine[CAUSES].get(cause, 0) + n
        for key in LATEST:
            mine[key].update(theirs[key])
        return self

    def reduce(self) -> dict[str, int | float | str]:
        """The interval's log line (vLLM prints ``key=value`` pairs): the consumer's part, the producer's, or both."""
        d = self.data
        out: dict[str, int | float | str] = {}
        if any(d[key] for key in (*COUNTERS, *SAMPLES, CAUSES) if key not in _PRODUCER_KEYS):
            n, mb = d["reads_done"], d["bytes_read"] / 2**20
            post, transfer = np.asarray(d["post_s"]), np.asarray(d["transfer_s"])
            seconds = float(transfer.sum())
            out.update({
                "Reads done": n, "Reads failed": d["reads_failed"], "Reads refused": d["reads_refused"],
                "Reads aborted": d["reads_aborted"], "Loads failed": d["loads_failed"], "MB read": round(mb, 3),
                "Avg MB per read": round(mb / n, 3) if n else 0,
                "Avg post time (ms)": _ms(post.mean()) if post.size else 0,
                "P90 post time (ms)": _ms(np.percentile(post, 90)) if post.size else 0,
                "Avg transfer time (ms)": _ms(transfer.mean()) if transfer.size else 0,
                "P90 transfer time (ms)": _ms(np.percentile(transfer, 90)) if transfer.size else 0,
                "Throughput (MB/s)": round(mb / seconds, 3) if seconds > 0 else 0,
            })
            if d["hit_reads"]:
                out.update({"Reads after a prefix hit": d["hit_reads"], "Hit tokens": d["hit_tokens"],
                            "MB saved by hits": round(d["hit_bytes"] / 2**20, 3)})
            if d[CAUSES]:
                out["Failure causes"] = ",".join(f"{cause}:{n}" for cause, n in sorted(d[CAUSES].items()))
        if any(d[key] for key in _PRODUCER_KEYS):
            out.update({"Held blocks": sum(d["held_blocks"].values()),
                        "Held requests": sum(d["held_requests"].values()), "Holds expired": d["holds_expired"]})
        return out


def _ms(seconds) -> float:
    return round(float(seconds) * 1e3, 3)


class ReadTally:
    """What one worker rank saw since vLLM last took its stats; WorkerSide feeds it, on vLLM's one hook thread."""

    def __init__(self, tp_rank: int):
        self.rank = str(tp_rank)
        self._data = _normalized(None)
        self._counts_taken: dict[str, int] = {}  # WorkerSide.counts at the last take
        self._expired_taken = 0
        self._held_sent: tuple[int, int] | None = None

    def on_read(self, result: ReadResult, hit: Hit | None = None) -> None:
        """One finished read (Consumer.poll's result) and what its local prefix hit saved; post and transfer
        time as the consumer measured them."""
        d = self._data
        if result.state is ReadState.DONE:
            d["blocks_read"] += hit.blocks_read if hit is not None else 0
            if hit is not None and hit.tokens:
                d["hit_reads"] += 1
                d["hit_tokens"] += hit.tokens
                d["hit_blocks"] += hit.blocks
                d["hit_bytes"] += hit.bytes
            d["reads_done"] += 1
            d["bytes_read"] += result.num_bytes
            d["descriptors"] += result.num_descriptors
            posted = result.posted_at or result.started_at
            d["post_s"].append(max(0.0, posted - result.started_at))  # admitted -> posted (handshake, plan)
            d["transfer_s"].append(max(0.0, result.finished_at - posted))  # posted -> DONE (the copy, any scatter)
        elif result.state is ReadState.FAILED:
            d["reads_failed"] += 1
            cause = result.cause.value if isinstance(result.cause, FailureCause) else "unknown"
            d[CAUSES][cause] = d[CAUSES].get(cause, 0) + 1
        elif result.state is ReadState.ABORTED:
            d["reads_aborted"] += 1

    def take(self, counts: dict[str, int], producer) -> HybridKVConnectorStats | None:
        """The stats since the last take (None when nothing happened); ``counts`` is WorkerSide.counts.

        A producer rank's held figures are sent while non-zero and once more when they drop to zero:
        every interval that saw a step then names every rank that holds something (the log line's sum
        is right), and nothing is sent by an idle rank.
        """
        d, self._data = self._data, _normalized(None)
        for key in ("reads_refused", "loads_failed"):
            now = counts.get(key, 0)
            d[key] += now - self._counts_taken.get(key, 0)
            self._counts_taken[key] = now
        if producer is not None:
            expired = producer.terminal_counts.get("expired", 0)
            d["holds_expired"] += expired - self._expired_taken
            self._expired_taken = expired
            held = (producer.num_held_blocks, producer.num_held_requests)
            if any(held) or held != self._held_sent:
                d["held_blocks"][self.rank], d["held_requests"][self.rank] = held
                self._held_sent = held
        stats = HybridKVConnectorStats(data=d)
        return None if stats.is_empty() else stats


# (data key, metric name, help). Counter names get prometheus_client's _total suffix.
_COUNTER_SERIES = (
    ("reads_done", "vllm:hybrid_transfer_reads", "Reads of a hybrid (attention + GDN) cache finished DONE, per "
     "decode rank."),
    ("reads_aborted", "vllm:hybrid_transfer_aborted_reads", "Reads aborted (the request went away), per decode rank."),
    ("reads_refused", "vllm:hybrid_transfer_refused_reads", "Reads refused before any byte moved (the worker's or "
     "the consumer's check of the ticket and block ids)."),
    ("loads_failed", "vllm:hybrid_transfer_failed_loads", "Loads the scheduler failed before any read "
     "(kv_transfer_params refused)."),
    ("bytes_read", "vllm:hybrid_transfer_read_bytes", "Bytes moved by DONE reads."),
    ("descriptors", "vllm:hybrid_transfer_descriptors", "NIXL descriptors of DONE reads."),
    ("holds_expired", "vllm:hybrid_transfer_expired_holds", "Producer holds whose lease ran out before decode "
     "reported (their blocks went back to vLLM)."),
    ("blocks_read", "vllm:hybrid_transfer_read_blocks", "Attention blocks DONE reads wrote (per attention group)."),
    ("hit_reads", "vllm:hybrid_transfer_hit_reads", "DONE reads that started past a local prefix hit."),
    ("hit_tokens", "vllm:hybrid_transfer_hit_tokens", "Prompt tokens local prefix hits held, so no read moved them."),
    ("hit_blocks", "vllm:hybrid_transfer_hit_blocks", "Attention blocks local prefix hits held (per attention "
     "group), so no read wrote them."),
    ("hit_bytes", "vllm:hybrid_transfer_hit_bytes", "Bytes local prefix hits saved the reads."),
)
_HISTOGRAM_SERIES = (
    ("post_s", "vllm:hybrid_transfer_post_time_seconds", "Per DONE read: from start_load_kv's order to the READ "
     "posted (a new producer's handshake, planning)."),
    ("transfer_s", "vllm:hybrid_transfer_transfer_time_seconds", "Per DONE read: from the READ posted to DONE."),
)
_GAUGE_SERIES = (
    ("held_blocks", "vllm:hybrid_transfer_held_blocks", "Blocks the producer ranks hold now for decode to read."),
    ("held_requests", "vllm:hybrid_transfer_held_requests", "Requests the producer ranks hold now."),
)
FAILED_READS = "vllm:hybrid_transfer_failed_reads"


class HybridPromMetrics(KVConnectorPromMetrics):
    """The connector's series on vLLM's ``/metrics``, one child per engine (vLLM's labels: model_name, engine)."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {key: self._per_engine(self._counter_cls(name=name, documentation=doc,
                                                                  labelnames=labelnames))
                          for key, name, doc in _COUNTER_SERIES}
        self._histograms = {key: self._per_engine(self._histogram_cls(name=name, documentation=doc,
                                                                      labelnames=labelnames,
                                                                      buckets=list(LATENCY_BOUNDS_S)))
                            for key, name, doc in _HISTOGRAM_SERIES}
        self._gauges = {key: self._per_engine(self._gauge_cls(name=name, documentation=doc, labelnames=labelnames,
                                                              multiprocess_mode="mostrecent"))
                        for key, name, doc in _GAUGE_SERIES}
        self._failed = self._counter_cls(name=FAILED_READS, documentation="Reads that FAILED, by cause (the "
                                         "consumer's FailureCause); vLLM applied kv_load_failure_policy.",
                                         labelnames=[*labelnames, "cause"])
        for values in per_engine_labelvalues.values():  # every cause shows, at 0, before the first failure
            for cause in FailureCause:
                self._failed.labels(*values, cause.value)
        self._latest: dict[tuple[int, str], dict[str, int]] = {}  # (engine, gauge key) -> producer rank -> value

    def _per_engine(self, metric) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data
        for key, children in self._counters.items():
            if n := int(data.get(key, 0)):
                children[engine_idx].inc(n)
        for key, children in self._histograms.items():
            for seconds in data.get(key, ()):
                children[engine_idx].observe(seconds)
        labels = self.per_engine_labelvalues[engine_idx]
        for cause, n in (data.get(CAUSES) or {}).items():
            self._failed.labels(*labels, str(cause)).inc(int(n))
        for key, children in self._gauges.items():
            if ranks := data.get(key):  # only the ranks that reported: the others keep their last value
                latest = self._latest.setdefault((engine_idx, key), {})
                latest.update({str(r): int(v) for r, v in ranks.items()})
                children[engine_idx].set(sum(latest.values()))
