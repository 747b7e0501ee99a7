"""The connector's transfers through vLLM's own stats path (integrations/vllm/stats.py, issue 26 Deliver 4).

Engine tests: vLLM's real schedulers and its ``KVOutputAggregator`` over worker connectors on real NIXL
between processes (the stats objects cross the host pipe pickled, as they cross vLLM's worker queue);
each step's ``SchedulerStats`` is msgpack-encoded and decoded as the engine core sends it to the front
end, and fed to vLLM's own ``LoggingStatLogger`` and ``PrometheusStatLogger``. What they show is checked
against figures computed apart from the stats code: the bytes the layout says each read needs (the
consumer's byte check makes a DONE read move exactly that), the consumer's own descriptor count, the
producer's own count of held blocks.
"""

from __future__ import annotations

import pickle
from types import SimpleNamespace
from unittest import mock

import pytest
from driver import Engine, run_until, through_json
from flows import drain, ticket_params
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from vllm.v1.engine import EngineCoreOutputs
from vllm.v1.metrics import loggers
from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from hybrid_transfer.engine.lifecycle.state import FailureCause, ReadResult, ReadState
from hybrid_transfer.integrations.vllm import HybridNixlConnector
from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.integrations.vllm.stats import FAILED_READS, HybridKVConnectorStats, ReadTally

N = 100


# ---- the engine path ----------------------------------------------------------------------------
class Captured:
    """Every step's SchedulerStats of one engine, as the front end receives them (msgpack round trip)."""

    def __init__(self, engine: Engine):
        self.steps: list[SchedulerStats] = []
        self.worker_types: set[type] = set()
        update = engine.scheduler.update_from_output
        encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

        def recording(scheduler_output, runner_output):
            kv = runner_output.kv_connector_output
            if kv is not None and kv.kv_connector_stats is not None:
                self.worker_types.add(type(kv.kv_connector_stats))
            outputs = update(scheduler_output, runner_output)
            for eco in outputs.values():
                if eco.scheduler_stats is not None:
                    self.steps.append(decoder.decode(encoder.encode(eco)).scheduler_stats)
            return outputs

        engine.scheduler.update_from_output = recording

    def total(self, key: str) -> int:
        return sum(s.kv_connector_stats.get(key, 0) for s in self.steps if s.kv_connector_stats)


class FrontEnd:
    """vLLM's two stat loggers of one engine (engine index 0), fed what the engine core sent."""

    def __init__(self, engine: Engine):
        cfg = engine.vllm_config
        self.log = LoggingStatLogger(cfg)
        self.prom = PrometheusStatLogger(cfg, engine_indexes=[0])  # unregisters any earlier vllm: series
        self.labels = {"model_name": cfg.model_config.served_model_name, "engine": "0"}

    def feed(self, steps) -> None:
        for stats in steps:
            self.log.record(scheduler_stats=stats, iteration_stats=None)
            self.prom.record(scheduler_stats=stats, iteration_stats=None)

    def log_lines(self) -> list[str]:
        """What one interval's log call prints (info, or debug while the engine is idle)."""
        lines = []
        capture = mock.Mock(side_effect=lambda msg, *args: lines.append(msg % args if args else msg))
        with mock.patch.object(loggers, "logger", mock.Mock(info=capture, debug=capture)):
            self.log.log()
        return [line for line in lines if line.startswith("KV Transfer metrics")]

    def value(self, name: str, **labels) -> float | None:
        return REGISTRY.get_sample_value(name, {**self.labels, **labels})


def _read_figures(state, key, num_tokens: list[int]) -> dict[str, int]:
    """In a decode rank's host: what the layout says its reads need, and its consumer's own counts."""
    from hybrid_transfer.plan.validate import expected_bytes

    worker = state.ranks[key].connector._worker
    m = worker.consumer.metrics()
    return {"needed": sum(expected_bytes(worker.engine.cache.geometry, n) for n in num_tokens),
            "descriptors": m.descriptors, "done": m.done}


def _held(p: Engine) -> tuple[int, int]:
    held = [p.call("producer", rank=r) for r in range(len(p.keys))]
    return sum(h["num_held_blocks"] for h in held), sum(h["num_held_requests"] for h in held)


def test_transfers_reach_the_log_line_and_metrics_of_both_engines(model_dir, hosts):
    """P TP2 -> D TP2, two requests: every figure merged over ranks by vLLM and shown in both places."""
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=2, block_size=16, kv_role="kv_producer", is_prefill=True)
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=2, block_size=32, kv_role="kv_consumer", is_prefill=False)
    p_stats, d_stats = Captured(p), Captured(d)
    lengths = {"a": N, "b": 40}
    try:
        for tag, n in lengths.items():
            p.add(f"p-{tag}", n, params={kvp.DO_REMOTE_DECODE: True})
        finished = {}
        run_until("every prefill", lambda: len(finished) == len(lengths), [p],
                  on_step=lambda e, r: finished.update(r.finished))
        run_until("both ranks hold both requests", lambda: _held(p)[1] == 2 * len(lengths), [p])
        held_blocks, _ = _held(p)
        p_mid = len(p_stats.steps)
        for tag, n in lengths.items():
            d.add(f"d-{tag}", n, params=through_json(finished[f"p-{tag}"].kv_transfer_params))
        received: set[str] = set()
        run_until("every load", lambda: len(received) == len(lengths), [d, p],
                  on_step=lambda e, r: received.update(r.finished_recving) if e is d else None)
        drain((p, d))
        figures = [d.call("call", _read_figures, [n - 1 for n in lengths.values()], rank=r) for r in range(2)]
    finally:
        p.shutdown()
        d.shutdown()

    assert d_stats.worker_types == {HybridKVConnectorStats}  # vLLM's aggregator kept our type across ranks
    reads = 2 * len(lengths)  # one read per decode rank per request
    needed = sum(f["needed"] for f in figures)
    assert sum(f["done"] for f in figures) == reads
    assert d_stats.total("reads_done") == reads and d_stats.total("reads_failed") == 0
    assert d_stats.total("bytes_read") == needed  # coalesced: exactly what the layout says
    assert d_stats.total("descriptors") == sum(f["descriptors"] for f in figures)

    front = FrontEnd(d)
    front.feed(d_stats.steps)
    assert front.value("vllm:hybrid_transfer_reads_total") == reads
    assert front.value("vllm:hybrid_transfer_read_bytes_total") == needed
    assert front.value("vllm:hybrid_transfer_descriptors_total") == d_stats.total("descriptors")
    for series in ("post_time", "transfer_time"):
        assert front.value(f"vllm:hybrid_transfer_{series}_seconds_count") == reads
        assert front.value(f"vllm:hybrid_transfer_{series}_seconds_sum") >= 0
    for cause in FailureCause:
        assert front.value(f"{FAILED_READS}_total", cause=cause.value) == 0
    assert front.value("vllm:hybrid_transfer_refused_reads_total") == 0
    assert front.value("vllm:hybrid_transfer_held_blocks") == 0  # a decode-only engine holds nothing
    [line] = front.log_lines()
    assert f"Reads done={reads}, Reads failed=0, Reads refused=0" in line
    assert f"MB read={round(needed / 2**20, 3)}" in line and "Held blocks" not in line

    front = FrontEnd(p)
    front.feed(p_stats.steps[:p_mid])
    assert held_blocks > 0
    assert front.value("vllm:hybrid_transfer_held_blocks") == held_blocks
    assert front.value("vllm:hybrid_transfer_held_requests") == 2 * len(lengths)
    [line] = front.log_lines()
    assert f"Held blocks={held_blocks}, Held requests={2 * len(lengths)}, Holds expired=0" in line
    assert "Reads done" not in line  # a prefill-only engine reads nothing
    front.feed(p_stats.steps[p_mid:])
    assert front.value("vllm:hybrid_transfer_held_blocks") == 0  # every hold freed after decode's reads
    assert front.value("vllm:hybrid_transfer_held_requests") == 0
    [line] = front.log_lines()
    assert "Held blocks=0, Held requests=0" in line


def test_a_failed_read_is_counted_by_cause(model_dir, hosts):
    """A ticket naming a side channel nobody answers: the handshake fails, vLLM recomputes, the stats say why."""
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False,
               extra={"handshake_timeout_s": 1.0})
    captured = Captured(d)
    try:
        d.add("d-lost", N, params=ticket_params(N - 1))
        run_until("decode recomputes and finishes", d.is_empty, [d])
    finally:
        d.shutdown()
    assert captured.total("reads_failed") == 1 and captured.total("reads_done") == 0
    front = FrontEnd(d)
    front.feed(captured.steps)
    assert front.value(f"{FAILED_READS}_total", cause="handshake") == 1
    assert front.value(f"{FAILED_READS}_total", cause="nixl") == 0
    assert front.value("vllm:hybrid_transfer_reads_total") == 0
    [line] = front.log_lines()
    assert "Reads done=0, Reads failed=1" in line and "Failure causes=handshake:1" in line


# ---- the worker's tally -------------------------------------------------------------------------
def _result(state: ReadState, *, num_bytes=0, cause=None, started=10.0, posted=10.5, finished=12.0) -> ReadResult:
    return ReadResult("r", state, ((1,),), num_bytes, 3, started, finished, cause=cause, posted_at=posted)


def test_tally_counts_each_read_once_and_takes_deltas_of_the_worker_counts():
    tally = ReadTally(tp_rank=1)
    counts = {"reads_refused": 2, "loads_failed": 1}
    tally.on_read(_result(ReadState.DONE, num_bytes=1000))
    tally.on_read(_result(ReadState.FAILED, cause=FailureCause.DEADLINE))
    tally.on_read(_result(ReadState.ABORTED))
    d = tally.take(counts, None).data
    assert (d["reads_done"], d["reads_failed"], d["reads_aborted"], d["bytes_read"], d["descriptors"]) == \
        (1, 1, 1, 1000, 3)
    assert d["post_s"] == [0.5] and d["transfer_s"] == [1.5] and d["failure_causes"] == {"deadline": 1}
    assert (d["reads_refused"], d["loads_failed"]) == (2, 1) and not d["held_blocks"]
    assert tally.take(counts, None) is None  # taken: nothing new
    counts["reads_refused"] += 3
    assert tally.take(counts, None).data["reads_refused"] == 3


def test_held_figures_are_sent_while_non_zero_and_once_at_zero():
    producer = SimpleNamespace(num_held_blocks=0, num_held_requests=0, terminal_counts={})
    tally = ReadTally(tp_rank=0)
    assert tally.take({}, producer).data["held_blocks"] == {"0": 0}  # the first report, at start
    assert tally.take({}, producer) is None  # idle: nothing
    producer.num_held_blocks, producer.num_held_requests = 7, 2
    for _ in range(2):  # every step while holding: each log interval names every holding rank
        d = tally.take({}, producer).data
        assert (d["held_blocks"], d["held_requests"]) == ({"0": 7}, {"0": 2})
    producer.num_held_blocks, producer.num_held_requests, producer.terminal_counts = 0, 0, {"expired": 2}
    d = tally.take({}, producer).data
    assert d["held_blocks"] == {"0": 0} and d["holds_expired"] == 2
    assert tally.take({}, producer) is None


def test_worker_refusals_reach_the_stats(monkeypatch):
    """A read whose local blocks lie outside the cache is refused by the worker's check; a fail order is counted."""
    import test_worker_refusals as refusals

    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import EngineConfig, auth
    from hybrid_transfer.integrations.vllm.geometry import EngineCache
    from hybrid_transfer.integrations.vllm.metadata import FailOrder, HybridConnectorMetadata, ReadOrder
    from hybrid_transfer.integrations.vllm.worker import WorkerSide
    from hybrid_transfer.layout import RankGeometry, model_from_config

    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    cache = HybridCache.allocate(RankGeometry(model_from_config(refusals.TINY_CONFIG, name="tiny"), 1, 0), 16)
    worker = WorkerSide(EngineCache(cache, None, {}), EngineConfig(), engine_id="d", incarnation=1,
                        is_producer=False, is_consumer=True)
    ticket = refusals._edited(0)
    meta = HybridConnectorMetadata(reads={"r0": ReadOrder(ticket, ((0, 99), (1,), (2,), (3,)), 20)},
                                   fails={"f0": FailOrder(None, "refused params")})
    try:
        worker.start(meta)
        _, recving, failed = worker.results()
        assert recving == failed == {"r0", "f0"}
        d = worker.stats().data
        assert (d["reads_refused"], d["loads_failed"], d["reads_done"], d["reads_failed"]) == (1, 1, 0, 0)
        assert worker.stats() is None
    finally:
        worker.close()


# ---- the stats object vLLM moves ----------------------------------------------------------------
def test_build_from_nothing_or_an_older_sender():
    assert HybridNixlConnector.build_kv_connector_stats().is_empty()
    assert HybridNixlConnector.build_kv_connector_stats(None).reduce() == {}
    old = HybridNixlConnector.build_kv_connector_stats({"reads_done": 1, "bytes_read": 5, "post_s": [0.0],
                                                        "transfer_s": [0.0]})
    assert old.data["reads_refused"] == 0 and old.data["held_blocks"] == {}  # missing keys count as zero
    assert old.reduce()["Throughput (MB/s)"] == 0  # no division by a zero transfer time


def test_the_dict_passed_in_is_not_aliased():
    """vLLM's log accumulator aggregates into the stats it built from a step's dict: that dict must stay as sent."""
    sent = {"reads_done": 1, "post_s": [0.1], "held_blocks": {"0": 3}}
    acc = HybridNixlConnector.build_kv_connector_stats(sent)
    acc.aggregate(HybridKVConnectorStats(data={"reads_done": 2, "post_s": [0.2], "held_blocks": {"0": 1}}))
    assert sent == {"reads_done": 1, "post_s": [0.1], "held_blocks": {"0": 3}}
    assert acc.data["reads_done"] == 3 and acc.data["post_s"] == [0.1, 0.2] and acc.data["held_blocks"] == {"0": 1}


_step = st.fixed_dictionaries({
    "reads_done": st.integers(0, 3), "reads_failed": st.integers(0, 2), "bytes_read": st.integers(0, 10**9),
    "reads_refused": st.integers(0, 2), "holds_expired": st.integers(0, 1),
    "post_s": st.lists(st.floats(0, 10), max_size=3), "transfer_s": st.lists(st.floats(0, 10), max_size=3),
    "failure_causes": st.dictionaries(st.sampled_from([c.value for c in FailureCause]), st.integers(1, 3),
                                      max_size=2),
    "held_blocks": st.dictionaries(st.sampled_from(["0", "1"]), st.integers(0, 50), max_size=2),
})


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(_step, min_size=1, max_size=2), max_size=6))
def test_aggregation_in_vllm_order_gives_the_totals(steps):
    """Ranks merged per step (the aggregator), steps merged per interval (the log accumulator), every object
    pickled and every dict msgpack'd on the way: counters sum, samples concatenate, held figures keep the latest."""
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    acc = None
    for ranks in steps:
        merged = None
        for data in ranks:
            worker = pickle.loads(pickle.dumps(HybridKVConnectorStats(data=data)))
            merged = worker if merged is None else merged.aggregate(worker)
        sent = decoder.decode(encoder.encode(EngineCoreOutputs(
            scheduler_stats=SchedulerStats(kv_connector_stats=merged.to_dict())))).scheduler_stats.kv_connector_stats
        built = HybridNixlConnector.build_kv_connector_stats(sent)
        acc = built if acc is None else acc.aggregate(built)
    flat = [data for ranks in steps for data in ranks]
    if acc is None:
        return
    for key in ("reads_done", "reads_failed", "bytes_read", "reads_refused", "holds_expired"):
        assert acc.data[key] == sum(data[key] for data in flat)
    assert acc.data["post_s"] == [v for data in flat for v in data["post_s"]]
    for cause in FailureCause:
        assert acc.data["failure_causes"].get(cause.value, 0) == sum(d["failure_causes"].get(cause.value, 0)
                                                                    for d in flat)
    latest = {}
    for data in flat:
        latest.update(data["held_blocks"])
    assert acc.data["held_blocks"] == latest
    assert acc.is_empty() == (not any(any(data.values()) for data in flat))
    assert bool(acc.reduce()) != acc.is_empty()  # vLLM 0.32 logs whatever reduce() gives once not empty
    acc.reset()
    assert acc.is_empty()


@pytest.mark.parametrize("key", ["post_s", "held_blocks"])
def test_reduce_names_each_side_it_saw(key):
    data = {"post_s": [0.001]} if key == "post_s" else {"held_blocks": {"1": 4}}
    line = HybridKVConnectorStats(data=data).reduce()
    assert ("Reads done" in line) == (key == "post_s") and ("Held blocks" in line) == (key == "held_blocks")
