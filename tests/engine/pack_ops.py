"""Worker-side helpers for the pack-mode tests (run through harness ``call``), CPU or CUDA caches."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

from harness import WAIT_POLL_S, EngineRanks, RankSpec, _Rank


@dataclass(frozen=True)
class PackResult:
    """A consumer's ReadResult with its pack fields, flattened so it pickles."""

    request_id: str
    state: str
    num_bytes: int
    num_descriptors: int
    num_packed_sources: int
    num_fallback_sources: int
    gather_s: float
    read_s: float
    scatter_s: float
    post_to_done_s: float
    error: str | None = None
    unstaged_sources: tuple[int, ...] = ()


def create_rank(state, key, spec: RankSpec, is_producer: bool, config, device: str, engine_id: str,
                incarnation: int = 0):
    """A producer or consumer over a cache on ``device`` (consumers poisoned); returns a producer's address."""
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Consumer, Producer
    from hybrid_transfer.verify import poison

    cache = HybridCache.allocate(spec.geometry(), spec.num_blocks, device=device)
    if is_producer:
        engine = Producer(cache, config, engine_id=engine_id, incarnation=incarnation)
        state.ranks[key] = _Rank(engine, True)
        return engine.address
    poison(cache)
    _sync(device)  # the poison is in place before any READ can land
    state.ranks[key] = _Rank(Consumer(cache, config, engine_id=engine_id), False)
    return None


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def fill_and_hold(state, key, request_id, layout, seed, nonce):
    """harness's fill_and_hold, with the fill finished before hold() (its contract on a GPU)."""
    from hybrid_transfer.engine import encode_ticket
    from hybrid_transfer.verify import fill_source

    producer = state.ranks[key].engine
    fill_source(producer.cache, layout, seed)
    _sync(str(producer.cache.device))
    return encode_ticket(producer.hold(request_id, layout.block_ids, layout.num_tokens, nonce=nonce))


def hold_on_every_rank(producers: EngineRanks, request_id: str, layout, seed: int) -> bytes:
    """Hold on every producer rank (rank 0 draws the nonce); rank 0's ticket bytes."""
    from hybrid_transfer.engine import decode_ticket

    first = producers.workers[0].call("call", fill_and_hold, producers.keys[0], request_id, layout, seed, None)
    nonce = decode_ticket(first).nonce
    for w, k in zip(producers.workers[1:], producers.keys[1:], strict=True):
        assert w.call("call", fill_and_hold, k, request_id, layout, seed, nonce) == first
    return first


def wait_results(state, key, request_ids, timeout_s) -> list[PackResult]:
    rank = state.ranks[key]
    deadline = time.monotonic() + timeout_s
    while not all(r in rank.results for r in request_ids) and time.monotonic() < deadline:
        state.poll_all()
        time.sleep(WAIT_POLL_S)
    out = []
    for rid in request_ids:
        r = rank.results.pop(rid, None)
        if r is None:
            out.append(PackResult(rid, "timeout", 0, 0, 0, 0, 0.0, 0.0, 0.0, 0.0))
            continue
        out.append(PackResult(rid, r.state.value, r.num_bytes, r.num_descriptors, r.num_packed_sources,
                              r.num_fallback_sources, r.gather_s, r.read_s, r.scatter_s, r.finished_at - r.posted_at,
                              f"{type(r.error).__name__}: {r.error}" if r.error else None, r.unstaged_sources))
    return out


def pack_status(state, key) -> dict:
    """Pack counters and pool use of a hosted rank."""
    from dataclasses import asdict

    engine = state.ranks[key].engine
    if state.ranks[key].is_producer:
        stager = engine.stager
        if stager is None:  # a producer that does not stage (not in pack or auto mode)
            return {"stats": {}, "bytes_in_use": 0, "num_slices": 0}
        return {"stats": asdict(stager.stats), "bytes_in_use": stager.pool.bytes_in_use,
                "num_slices": stager.pool.num_slices}
    pack = engine._pack
    return {"stats": asdict(pack.stats), "bytes_in_use": pack.pool.bytes_in_use if pack.pool else 0,
            "cost": pack.cost}


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def start_log_capture(state, logger_name: str) -> None:
    """Keep the warnings ``logger_name`` emits in this worker until stop_log_capture."""
    handler = state.extra[f"log:{logger_name}"] = _Capture()
    logging.getLogger(logger_name).addHandler(handler)


def stop_log_capture(state, logger_name: str) -> list[str]:
    handler = state.extra.pop(f"log:{logger_name}")
    logging.getLogger(logger_name).removeHandler(handler)
    return handler.messages


def auto_choices(state, key, ticket_bytes, local_block_ids) -> int:
    """How many sources the consumer's cost model sends through staging for this request (planned here)."""
    from hybrid_transfer.engine import decode_ticket
    from hybrid_transfer.plan.types import PackSourcePlan, PlanMode

    consumer = state.ranks[key].engine
    t = decode_ticket(ticket_bytes)
    link = consumer._peers.ensure(t.engine_key, t.addresses).resolve()
    plan = link.planner.plan(local_block_ids, t.block_ids, t.num_tokens, PlanMode.AUTO, cost=consumer.cost_model)
    return sum(isinstance(s, PackSourcePlan) for s in plan.sources)


def start_engine(workers, specs, config, device: str, is_producer: bool) -> EngineRanks:
    """Every rank of one engine, rank r on workers[r]."""
    import os

    engine_id = f"{'prefill' if is_producer else 'decode'}-{uuid.uuid4().hex[:6]}"
    incarnation = int.from_bytes(os.urandom(6), "little")
    keys = [f"{engine_id}-{s.tp_rank}" for s in specs]
    addresses = [w.call("call", create_rank, k, s, is_producer, config, device, engine_id, incarnation)
                 for w, k, s in zip(workers, keys, specs, strict=True)]
    if is_producer and len(specs) > 1:
        for w, k in zip(workers, keys, strict=True):
            w.call("set_engine_addresses", k, addresses)
    return EngineRanks(list(workers), keys, list(specs), addresses if is_producer else [], engine_id, incarnation)


# ---- the test side ---------------------------------------------------------------
def run_pack(cluster, prefill_tp, decode_tp, p_opts, c_opts, config, *, device="cpu", model=None, num_blocks=64,
             token_counts=(37, 64, 1, 0, 100), seed=0, producer_config=None):
    """Hold requests on a producer engine, read them on a consumer engine, check every byte.

    Returns (results per consumer rank, producer pack status per rank, consumer pack status per rank,
    auto mode's expected packed sources per consumer rank and request or None), taken after every
    producer freed every request.
    """
    import numpy as np
    from harness import TINY
    from test_transfer import _layouts

    model = TINY if model is None else model
    p_specs = [RankSpec(model, prefill_tp, r, num_blocks, p_opts) for r in range(prefill_tp)]
    c_specs = [RankSpec(model, decode_tp, r, num_blocks, c_opts) for r in range(decode_tp)]
    workers = cluster.workers
    producers = start_engine(workers[:prefill_tp], p_specs, producer_config or config, device, True)
    consumers = start_engine(workers[prefill_tp:prefill_tp + decode_tp], c_specs, config, device, False)
    try:
        rng = np.random.default_rng(seed)
        remote_layouts = _layouts(p_specs[0].geometry(), list(token_counts), num_blocks, rng, extra=0)
        local_layouts = _layouts(c_specs[0].geometry(), list(token_counts), num_blocks, rng, extra=1)
        ids = [f"req-{i}" for i in range(len(token_counts))]
        tickets = [hold_on_every_rank(producers, rid, layout, 1000 + i)
                   for i, (rid, layout) in enumerate(zip(ids, remote_layouts, strict=True))]
        for d in range(decode_tp):
            for ticket, layout in zip(tickets, local_layouts, strict=True):
                consumers.workers[d].call("start_read", consumers.keys[d], ticket, layout.block_ids,
                                          layout.num_tokens)
        results = [consumers.workers[d].call("call", wait_results, consumers.keys[d], ids, 60.0)
                   for d in range(decode_tp)]
        for per_rank in results:
            assert [r.state for r in per_rank] == ["done"] * len(ids), per_rank
        for w, k in zip(producers.workers, producers.keys, strict=True):
            assert w.call("wait_freed", k, ids, 30.0) == sorted(ids)
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("check", k, [(layout, 1000 + i) for i, layout in enumerate(local_layouts)])
        p_status = [w.call("call", pack_status, k) for w, k in zip(producers.workers, producers.keys, strict=True)]
        c_status = [w.call("call", pack_status, k) for w, k in zip(consumers.workers, consumers.keys, strict=True)]
        choices = None
        if config.mode.value == "auto":
            choices = [[consumers.workers[d].call("call", auto_choices, consumers.keys[d], t, lay.block_ids)
                        for t, lay in zip(tickets, local_layouts, strict=True)] for d in range(decode_tp)]
        return results, p_status, c_status, choices
    finally:
        producers.close()
        consumers.close()


def slow_scatters(state, key, cycles: int) -> None:
    """CUDA: every scatter of this consumer first waits ``cycles`` GPU clock cycles on the copier's stream
    (its kernels then finish long after the poll that launched them returns), and the rank records:
    per scatter how many earlier scatters were still running (request i+1's READ was DONE and its
    scatter launched while request i's ran), and per request whether any scatter was still running when
    the request was forgotten (it is forgotten only after its result went out)."""
    import torch

    pack = state.ranks[key].engine._pack
    copier, seen = pack._copier, state.extra.setdefault(f"slow:{key}", {"running": [], "forgot_running": 0,
                                                                            "tickets": []})
    scatter, forget = copier.scatter, pack.forget

    def slow_scatter(staging, dst, length):
        if cycles:
            with torch.cuda.stream(copier._stream):
                torch.cuda._sleep(cycles)
        seen["running"].append(sum(not t.is_done for t in seen["tickets"]))
        ticket = scatter(staging, dst, length)
        seen["tickets"].append(ticket)
        return ticket

    def watching_forget(request_id):
        track = pack._tracks.get(request_id)
        if track is not None and track.req.state.value == "done":
            seen["forgot_running"] += sum(s.copy is not None and not s.copy.is_done for s in track.sources.values())
        forget(request_id)

    copier.scatter, pack.forget = slow_scatter, watching_forget


def slow_scatter_report(state, key) -> dict:
    seen = state.extra[f"slow:{key}"]
    return {"running": seen["running"], "forgot_running": seen["forgot_running"], "scatters": len(seen["tickets"])}
