"""One rank process of the benchmark: a Producer or a Consumer over its own cache, plus a ceiling agent.

The coordinator sends commands over a Pipe; they run one at a time on the process's main thread,
which owns every NIXL agent here. Between commands each rank keeps polling (progress is OFF,
DESIGN 7): a prefill rank its Producer and ceiling agent (a target that never polls stalls a first
READ), a decode rank its Consumer (which flushes its last completion notifications).
Timed windows live inside ``run_engine`` / ``run_ceiling`` (decode ranks) and ``serve`` (prefill
ranks); filling, poisoning, planning again and verifying happen in other commands, outside them.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from hybrid_transfer.bench.stats import ConsumerRun, PlanTiming, ProducerServe, RequestTiming
from hybrid_transfer.errors import BenchError, ConfigError

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.002  # wait for the next command between rounds of polling
SERVE_POLL_S = 0.001  # producer poll interval in a timed window: bounds the notification lag, costs CPU
STOP_GRACE_S = 10.0  # after "stop", how long a prefill rank still waits for outstanding frees
STOP = "stop"


@dataclass(frozen=True)
class RankSetup:
    """Everything a rank process needs to build its cache and engine."""

    preset: str
    kv_dtype: str | None
    is_prefill: bool
    tp_size: int
    tp_rank: int
    num_blocks: int
    device: str  # "cpu" or "cuda"
    gpu: int
    torch_threads: int
    engine_id: str
    incarnation: int
    mode: str  # the run's chosen plan mode (producers are built with it)
    log_level: str = "WARNING"
    poll_sleep_s: float = 0.0  # decode ranks' wait between polls that found nothing (0: spin with sched_yield)
    staging_bytes: int = 256 << 20  # pack / auto staging pool (sizing.staging_bytes)
    backend_threads: int | None = None  # EngineConfig.num_backend_threads
    split_batch_size: int | None = None  # EngineConfig.split_batch_size

    def engine_config(self, **fields):
        """The EngineConfig of this rank's agents (the UCX backend settings of the run, plus ``fields``)."""
        from hybrid_transfer.engine import EngineConfig

        return EngineConfig(num_backend_threads=self.backend_threads, split_batch_size=self.split_batch_size,
                            **fields)


@dataclass(frozen=True)
class EngineItem:
    """One request as a decode rank reads it."""

    request_id: str
    ticket: bytes
    local_block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


class _Rank:
    def __init__(self, conn):
        self.conn = conn
        self.setup: RankSetup | None = None
        self.cache: Any = None
        self.producer: Any = None
        self.consumer: Any = None
        self.planner: Any = None
        self.ceiling: Any = None
        self.copy: Any = None  # the physical-limit buffers (decode ranks)
        self.freed: dict[str, float] = {}

    # ---- helpers ------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for this process's device work: fills and poison must land before a READ may see them."""
        if self.setup is not None and self.setup.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def poll_idle(self) -> None:
        if self.consumer is not None:
            self.consumer.poll()  # progress NIXL: flushes the last completion notifications (progress is OFF)
        if self.producer is not None:
            now = time.monotonic()
            for rid in self.producer.poll():
                self.freed[rid] = now
        if self.ceiling is not None and self.setup.is_prefill:
            self.ceiling.agent.get_notifs()  # the target of ceiling READs: progress it too

    def close(self) -> None:
        self.copy = None
        for name in ("consumer", "ceiling", "producer"):
            obj = getattr(self, name)
            if obj is not None:
                try:
                    obj.close()
                except Exception as exc:  # noqa: BLE001 - teardown continues; the rest must close too
                    log.warning("closing %s failed: %s", name, exc)
                setattr(self, name, None)


# ---- commands -------------------------------------------------------------------------------
def op_setup(rank: _Rank, setup: RankSetup):
    """Allocate the cache (on this rank's GPU for cuda); prefill ranks return (address, descriptor)."""
    import torch

    from hybrid_transfer.bench.spec import KV_DTYPES
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Producer
    from hybrid_transfer.layout import CacheOptions, RankGeometry, load_preset
    from hybrid_transfer.plan.types import PlanMode

    torch.set_num_threads(setup.torch_threads)
    device = torch.device("cpu")
    if setup.device == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 0 <= setup.gpu < count:
            side = "prefill" if setup.is_prefill else "decode"
            raise ConfigError(f"{side} rank {setup.tp_rank} is placed on GPU {setup.gpu}, this host has {count} "
                              f"visible GPU(s)", field=f"{side}_gpus", value=setup.gpu)
        torch.cuda.set_device(setup.gpu)
        device = torch.device("cuda", setup.gpu)
    options = CacheOptions(kv_dtype=KV_DTYPES[setup.kv_dtype] if setup.kv_dtype else None)
    geometry = RankGeometry(load_preset(setup.preset), setup.tp_size, setup.tp_rank, options)
    rank.setup = setup
    rank.cache = HybridCache.allocate(geometry, setup.num_blocks, device)
    if not setup.is_prefill:
        return None
    config = setup.engine_config(mode=PlanMode(setup.mode), staging_bytes=setup.staging_bytes)
    rank.producer = Producer(rank.cache, config, engine_id=setup.engine_id,
                             incarnation=setup.incarnation)
    return rank.producer.address, rank.producer.descriptor


def op_set_engine_addresses(rank: _Rank, addresses):
    rank.producer.set_engine_addresses(addresses)


def op_fill(rank: _Rank, layouts, seeds):
    from hybrid_transfer.verify import fill_source

    for layout, seed in zip(layouts, seeds, strict=True):
        fill_source(rank.cache, layout, seed)
    rank.sync()


def op_hold(rank: _Rank, request_ids, layouts, nonces):
    """Hold requests (rank 0 draws nonces, the others pass them); returns (ticket bytes, hold seconds)."""
    from hybrid_transfer.engine import encode_ticket

    tickets, hold_s = [], []
    for i, (rid, layout) in enumerate(zip(request_ids, layouts, strict=True)):
        nonce = None if nonces is None else nonces[i]
        t0 = time.perf_counter()
        ticket = rank.producer.hold(rid, layout.block_ids, layout.num_tokens, nonce=nonce)
        hold_s.append(time.perf_counter() - t0)
        tickets.append(encode_ticket(ticket))
    # Pack and auto: hold() starts the gather into staging, on the GPU asynchronously. Let it finish before
    # the window opens, as it would between prefill and decode: it stays off the critical path (the engine
    # reports it as gather_s), and no stray gather competes with another variant's reads for bandwidth.
    rank.sync()
    return tickets, hold_s


def op_serve(rank: _Rank, request_ids):
    """A prefill rank's timed window: poll until every request is freed and the coordinator says stop."""
    cpu0 = time.process_time()
    stop_at = None
    pending = set(request_ids)
    while True:
        rank.poll_idle()
        pending -= rank.freed.keys()
        if stop_at is None and rank.conn.poll(0):
            message = rank.conn.recv()
            if message != STOP:
                raise BenchError(f"expected {STOP!r} during serve, got {message!r}")
            stop_at = time.monotonic() + STOP_GRACE_S
        if stop_at is not None and (not pending or time.monotonic() >= stop_at):
            break
        time.sleep(SERVE_POLL_S)
    cpu_s = time.process_time() - cpu0
    freed = {rid: rank.freed.pop(rid) for rid in request_ids if rid in rank.freed}
    return ProducerServe(rank.setup.tp_rank, freed, cpu_s)


def op_open_consumer(rank: _Rank, mode: str, address: str, producer_descriptors, timeout_s: float):
    """A Consumer in ``mode`` over this rank's cache, handshaked now (outside every timed window)."""
    from hybrid_transfer.engine import Consumer
    from hybrid_transfer.plan.planner import Planner
    from hybrid_transfer.plan.types import PlanMode

    if rank.consumer is not None:
        rank.consumer.close()
    config = rank.setup.engine_config(mode=PlanMode(mode), staging_bytes=rank.setup.staging_bytes)
    rank.consumer = Consumer(rank.cache, config, engine_id=rank.setup.engine_id)
    rank.consumer.connect(address, timeout_s=timeout_s)
    rank.planner = Planner(rank.cache.geometry.model, rank.consumer.descriptor, producer_descriptors)


def op_close_consumer(rank: _Rank):
    if rank.consumer is not None:
        rank.consumer.close()
        rank.consumer = None


def op_run_engine(rank: _Rank, items, concurrency: int, start_at: float):
    """A decode rank's timed window: keep ``concurrency`` requests in flight until all are DONE."""
    from hybrid_transfer.engine import decode_ticket

    consumer = rank.consumer
    queue = collections.deque((it.request_id, decode_ticket(it.ticket), it.local_block_ids, it.num_tokens)
                              for it in items)
    in_flight: dict[str, tuple[float, float]] = {}
    timings: list[RequestTiming] = []
    _sleep_until(start_at)
    cpu0 = time.process_time()
    while queue or in_flight:
        # One post per round, then a poll: on CPU the copy may run inside the post, so posting the
        # whole window before the first poll would charge every request for its predecessors' copies.
        if queue and len(in_flight) < concurrency:
            rid, ticket, local_ids, num_tokens = queue.popleft()
            t0 = time.monotonic()
            consumer.start_read(ticket, local_ids, expected_state_position=num_tokens)
            in_flight[rid] = (t0, time.monotonic())
        c0 = time.monotonic()
        results = consumer.poll()
        c1 = time.monotonic()
        if not results:
            _wait(rank.setup.poll_sleep_s)
            continue
        for r in results:
            if not r.ok:
                raise BenchError(f"request ended {r.state.value}: {type(r.error).__name__}: {r.error}",
                                 request_id=r.request_id)
            t0, t1 = in_flight.pop(r.request_id)
            timings.append(RequestTiming(
                r.request_id, t0, t1, r.finished_at, c1, r.num_bytes, r.num_descriptors, (c1 - c0) / len(results),
                gather_s=r.gather_s, query_s=r.query_s, scatter_s=r.scatter_s,
                packed_sources=r.num_packed_sources, fallback_sources=r.num_fallback_sources))
    return ConsumerRun(rank.setup.tp_rank, tuple(timings), time.process_time() - cpu0)


def op_plan_times(rank: _Rank, local_ids, remote_ids, num_tokens: int, mode: str):
    """Plan each request again with the engine's Planner class (same ids, same mode), timed one by one."""
    from hybrid_transfer.plan.types import PackSourcePlan, PlanMode

    plan_mode = PlanMode(mode)
    plan_s, descriptors, pieces = [], [], []
    rank.planner.plan(local_ids[0], remote_ids[0], num_tokens, plan_mode)  # fills the per-token-count cache
    for local, remote in zip(local_ids, remote_ids, strict=True):
        t0 = time.perf_counter()
        plan = rank.planner.plan(local, remote, num_tokens, plan_mode)
        plan_s.append(time.perf_counter() - t0)
        descriptors.append(plan.num_descriptors)
        pieces.append(sum(s.num_pieces if isinstance(s, PackSourcePlan) else s.num_descriptors
                          for s in plan.sources))
    return PlanTiming(rank.setup.tp_rank, tuple(plan_s), tuple(descriptors), tuple(pieces))


def op_poison(rank: _Rank):
    from hybrid_transfer.verify import POISON_BYTE, poison

    poison(rank.cache)
    if rank.ceiling is not None:
        rank.ceiling.buffer.fill_(POISON_BYTE)
    rank.sync()


def op_verify(rank: _Rank, layouts, seeds):
    """Every byte of the cache against the global-coordinate oracle (raises VerificationError)."""
    from hybrid_transfer.verify import check_destination_many

    rank.sync()
    check_destination_many(rank.cache, list(zip(layouts, seeds, strict=True)))


def op_ceiling_open(rank: _Rank, slots: int, slot_bytes: int, seed: int):
    """This rank's ceiling agent and buffer; a prefill rank fills it and returns (metadata, base, device id)."""
    import secrets

    from hybrid_transfer.bench.ceiling import CeilingEnd, fill_pattern

    s = rank.setup
    name = f"{s.engine_id}-ceiling-{'p' if s.is_prefill else 'c'}{s.tp_rank}-{secrets.token_hex(4)}"
    rank.ceiling = CeilingEnd(name, s.engine_config(), slots, slot_bytes, rank.cache.device)
    if s.is_prefill:
        fill_pattern(rank.ceiling.buffer, seed)
        rank.sync()
        return rank.ceiling.agent.metadata, rank.ceiling.base, rank.ceiling.device_id
    return None


def op_ceiling_add_sources(rank: _Rank, sources):
    """sources: (rank, metadata, base, slot bytes, device id, seed) of every prefill rank this rank reads."""
    for source in sources:
        rank.ceiling.add_source(*source)


def op_run_ceiling(rank: _Rank, request_ids, lengths: dict[int, int], concurrency: int, start_at: float):
    """A decode rank's ceiling window: per request one single-descriptor READ per source, ``concurrency`` deep."""
    from hybrid_transfer.engine.state import XferState

    ceiling = rank.ceiling
    queue = collections.deque(request_ids)
    free_slots = collections.deque(range(ceiling.slots))
    in_flight: dict[str, tuple[float, float, int, list]] = {}
    timings: list[RequestTiming] = []
    num_bytes = sum(lengths.values())
    _sleep_until(start_at)
    cpu0 = time.process_time()
    while queue or in_flight:
        if queue and free_slots and len(in_flight) < concurrency:  # one post per round, as in run_engine
            rid, slot = queue.popleft(), free_slots.popleft()
            t0 = time.monotonic()
            handles = ceiling.post(slot, lengths)
            in_flight[rid] = (t0, time.monotonic(), slot, handles)
        c0 = time.monotonic()
        finished = []
        for rid, (_, _, _, handles) in in_flight.items():
            states = [ceiling.agent.check(h) for h in handles]
            if XferState.ERR in states:
                raise BenchError("a ceiling READ ended in error", request_id=rid)
            if all(st is XferState.DONE for st in states):
                finished.append(rid)
        c1 = time.monotonic()
        if not finished:
            _wait(rank.setup.poll_sleep_s)
            continue
        for rid in finished:
            t0, t1, slot, handles = in_flight.pop(rid)
            for h in handles:
                ceiling.agent.release(h)
            free_slots.append(slot)
            timings.append(RequestTiming(rid, t0, t1, c1, c1, num_bytes, len(handles), (c1 - c0) / len(finished)))
    return ConsumerRun(rank.setup.tp_rank, tuple(timings), time.process_time() - cpu0)


def op_copy_open(rank: _Rank, sources):
    """The physical-limit buffers: sources are (rank, bytes per request, GPU index or None, seed)."""
    import torch

    from hybrid_transfer.bench.ceiling import CopySource

    cpu = rank.setup.device != "cuda"
    rank.copy = CopySource(rank.ceiling, {s: (n, torch.device("cpu") if cpu else torch.device("cuda", gpu), seed)
                                          for s, n, gpu, seed in sources})
    rank.sync()


def op_run_copy(rank: _Rank, request_ids, lengths: dict[int, int], concurrency: int, start_at: float):
    """A decode rank's physical-limit window: per request one torch copy per source, ``concurrency`` deep."""
    copy = rank.copy
    queue = collections.deque(request_ids)
    free_slots = collections.deque(range(copy.ceiling.slots))
    in_flight: dict[str, tuple[float, float, int, Any]] = {}
    timings: list[RequestTiming] = []
    num_bytes = sum(lengths.values())
    _sleep_until(start_at)
    cpu0 = time.process_time()
    while queue or in_flight:
        if queue and free_slots and len(in_flight) < concurrency:  # one post per round, as in run_engine
            rid, slot = queue.popleft(), free_slots.popleft()
            t0 = time.monotonic()
            end = copy.post(slot, lengths)
            in_flight[rid] = (t0, time.monotonic(), slot, end)
        c0 = time.monotonic()
        finished = [rid for rid, (_, _, _, end) in in_flight.items() if end is None or end.query()]
        c1 = time.monotonic()
        if not finished:
            _wait(rank.setup.poll_sleep_s)
            continue
        for rid in finished:
            t0, t1, slot, _ = in_flight.pop(rid)
            free_slots.append(slot)
            timings.append(RequestTiming(rid, t0, t1, c1, c1, num_bytes, len(lengths), (c1 - c0) / len(finished)))
    return ConsumerRun(rank.setup.tp_rank, tuple(timings), time.process_time() - cpu0)


def op_copy_verify(rank: _Rank, slots_used: int, lengths: dict[int, int]):
    rank.sync()
    for slot in range(slots_used):
        rank.copy.check_slot(slot, lengths)


def op_ceiling_verify(rank: _Rank, slots_used: int, lengths: dict[int, int]):
    rank.sync()
    for slot in range(slots_used):
        rank.ceiling.check_slot(slot, lengths)


def op_close(rank: _Rank):
    rank.close()


_OPS = {name.removeprefix("op_"): fn for name, fn in globals().items() if name.startswith("op_")}


def _wait(seconds: float) -> None:
    """Between polls that found nothing: spin (yielding the core) when ranks have cores to themselves."""
    if seconds > 0:
        time.sleep(seconds)
    else:
        os.sched_yield()


def _sleep_until(t: float) -> None:
    delay = t - time.monotonic()
    if delay > 0:
        time.sleep(delay)


def _describe(exc: BaseException) -> tuple[str, str]:
    return type(exc).__name__, str(exc)


def worker_main(conn) -> None:
    """Command loop of one rank process; replies ("ok", value) or ("err", (type name, message))."""
    # Only the coordinator writes stdout (the table); UCX and NIXL's logger would print there too.
    os.dup2(2, 1)
    rank = _Rank(conn)
    try:
        while True:
            if conn.poll(IDLE_POLL_S):
                message = conn.recv()
                if message is None:
                    break
                if message == STOP:  # a serve that already failed and answered: nothing to stop
                    continue
                op, args = message
                if op == "setup":
                    level = args[0].log_level.upper()
                    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
                    from hybrid_transfer.engine.agent import quiet_nixl_logging

                    quiet_nixl_logging(level)
                try:
                    reply = ("ok", _OPS[op](rank, *args))
                except BaseException as exc:  # noqa: BLE001 - every failure goes back to the coordinator
                    log.debug("command %s failed", op, exc_info=True)
                    reply = ("err", _describe(exc))
                conn.send(reply)
            rank.poll_idle()
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        rank.close()
