"""One rank process of the benchmark: a Producer or a Consumer over its own cache, plus a ceiling agent.

The coordinator sends typed commands (bench.messages) over a Pipe; each runs on the process's main thread,
which owns every NIXL agent here. Between commands each rank keeps polling (progress is OFF,
docs/tuning.md#progress-thread): a prefill rank its Producer and ceiling agent (a target that never polls stalls a first
READ), a decode rank its Consumer (which flushes its last completion notifications).
one at a time, in the handler HANDLERS maps its type to, and is answered with one typed reply.
Timed windows live inside RunEngine / RunCeiling (decode ranks) and Serve (prefill ranks); filling,
poisoning, planning again and verifying happen in other commands, outside them.
"""

from __future__ import annotations

import collections
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import msgspec

from hybrid_transfer.bench import messages as m
from hybrid_transfer.bench.spec import Device
from hybrid_transfer.bench.stats import ConsumerRun, PlanTiming, ProducerServe, RequestTiming
from hybrid_transfer.errors import BenchError, ConfigError

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.002  # wait for the next command between rounds of polling
# Set to a path prefix, each decode rank profiles its engine windows' start_reads calls and every poll (empty ones
# too) with cProfile and writes <prefix>.rank<R>.window<K>.<read transport>-<mode>-<requests> (pstats format).
# A developer's tool: the profiler slows those calls down, so the run's figures are not the unprofiled ones.
PROFILE_ENV = "HT_BENCH_PROFILE"
STOP_GRACE_S = 10.0  # after Stop, how long a prefill rank still waits for outstanding frees


class _Rank:
    def __init__(self, conn):
        self.conn = conn
        self.setup: m.RankSetup | None = None
        self.cache: Any = None
        self.producer: Any = None
        self.consumer: Any = None
        self.planner: Any = None
        self.mode: Any = None  # the open consumer's PlanMode
        self.ceiling: Any = None
        self.copy: Any = None  # the physical-limit buffers (decode ranks)
        self.freed: dict[str, float] = {}

    # ---- helpers ------------------------------------------------------------------
    def sync(self) -> None:
        """Wait for this process's device work: fills and poison must land before a READ may see them."""
        if self.setup is not None and self.setup.device is Device.CUDA:
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
def setup_rank(rank: _Rank, cmd: m.Setup) -> m.Reply:
    """Allocate the cache (on this rank's GPU for cuda); a prefill rank builds its Producer."""
    import torch

    from hybrid_transfer.bench.spec import KV_DTYPES
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Producer
    from hybrid_transfer.layout import CacheOptions, RankGeometry, load_preset

    setup = cmd.rank
    torch.set_num_threads(setup.torch_threads)
    device = torch.device("cpu")
    if setup.device is Device.CUDA:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not 0 <= setup.gpu < count:
            side = "prefill" if setup.is_prefill else "decode"
            raise ConfigError(f"{side} rank {setup.tp_rank} is placed on GPU {setup.gpu}, this host has {count} "
                              f"visible GPU(s)", field=f"{side}_gpus", value=setup.gpu)
        torch.cuda.set_device(setup.gpu)
        device = torch.device("cuda", setup.gpu)
    options = CacheOptions(kv_dtype=KV_DTYPES[setup.kv_dtype] if setup.kv_dtype else None, kv_layout=setup.kv_layout)
    geometry = RankGeometry(load_preset(setup.preset), setup.tp_size, setup.tp_rank, options)
    rank.setup = setup
    rank.cache = HybridCache.allocate(geometry, setup.num_blocks, device,
                                      shared=setup.shared_cache and device.type == "cpu")
    if not setup.is_prefill:
        return m.Done()
    # The bench holds every request of a point at once, its cache sized to hold exactly them (or, with
    # vllm-pool, them and the churn's ids): the hold cap is the whole cache, never the serving default.
    config = setup.engine_config(mode=setup.mode, staging_bytes=setup.staging_bytes, max_held_blocks=setup.num_blocks)
    rank.producer = Producer(rank.cache, config, engine_id=setup.engine_id,
                             incarnation=setup.incarnation)
    return m.Started(rank.producer.address, rank.producer.descriptor)


def set_engine_addresses(rank: _Rank, cmd: m.SetEngineAddresses) -> m.Reply:
    rank.producer.set_engine_addresses(cmd.addresses)
    return m.Done()


def fill(rank: _Rank, cmd: m.Fill) -> m.Reply:
    from hybrid_transfer.verify import fill_source

    for layout, seed in zip(cmd.layouts, cmd.seeds, strict=True):
        fill_source(rank.cache, layout, seed)
    rank.sync()
    return m.Done()


def hold(rank: _Rank, cmd: m.Hold) -> m.Reply:
    """Hold requests (rank 0 draws nonces, the others pass them); answers ticket bytes and hold seconds."""
    from hybrid_transfer.engine import encode_ticket

    tickets, hold_s = [], []
    for i, (rid, layout) in enumerate(zip(cmd.request_ids, cmd.layouts, strict=True)):
        nonce = None if cmd.nonces is None else cmd.nonces[i]
        t0 = time.perf_counter()
        ticket = rank.producer.hold(rid, layout.block_ids, layout.num_tokens, nonce=nonce)
        hold_s.append(time.perf_counter() - t0)
        tickets.append(encode_ticket(ticket))
    # Pack and auto: hold() starts the gather into staging, on the GPU asynchronously. Let it finish before
    # the window opens, as it would between prefill and decode: it stays off the critical path (the engine
    # reports it as gather_s), and no stray gather competes with another variant's reads for bandwidth.
    rank.sync()
    return m.Held(tickets, hold_s)


def serve(rank: _Rank, cmd: m.Serve) -> m.Reply:
    """A prefill rank's timed window: poll until every request is freed and the coordinator says Stop.

    Each claim confirmation and Staged notification a consumer waits on passes through this loop, so
    with a core per rank it spins like the decode ranks (a fixed 1 ms sleep added up to 1 ms to every
    request's latency); on a contended host it sleeps ``serve_sleep_s`` (coordinator.py says why).
    """
    cpu0 = time.process_time()
    stop_at = None
    pending = set(cmd.request_ids)
    while True:
        rank.poll_idle()
        pending -= rank.freed.keys()
        if stop_at is None and rank.conn.poll(0):
            message = m.decode_command(rank.conn.recv_bytes())
            if not isinstance(message, m.Stop):
                raise BenchError(f"expected Stop during Serve, got {type(message).__name__}")
            stop_at = time.monotonic() + STOP_GRACE_S
        if stop_at is not None and (not pending or time.monotonic() >= stop_at):
            break
        _wait(rank.setup.serve_sleep_s)
    cpu_s = time.process_time() - cpu0
    freed = {rid: rank.freed.pop(rid) for rid in cmd.request_ids if rid in rank.freed}
    return m.Served(ProducerServe(rank.setup.tp_rank, freed, cpu_s))


def open_consumer(rank: _Rank, cmd: m.OpenConsumer) -> m.Reply:
    """A Consumer in ``mode`` over this rank's cache, handshaked now (outside every timed window)."""
    from hybrid_transfer.engine import Consumer
    from hybrid_transfer.plan.planner import Planner

    if rank.consumer is not None:
        rank.consumer.close()
    config = rank.setup.engine_config(mode=cmd.mode, staging_bytes=rank.setup.staging_bytes,
                                      read_transport=cmd.read_transport)
    rank.consumer = Consumer(rank.cache, config, engine_id=rank.setup.engine_id)
    rank.consumer.connect(cmd.address, timeout_s=cmd.timeout_s)
    rank.planner = Planner(rank.cache.geometry.model, rank.consumer.descriptor, cmd.producer_descriptors)
    rank.mode = cmd.mode
    return m.Done()


def close_consumer(rank: _Rank, cmd: m.CloseConsumer) -> m.Reply:
    if rank.consumer is not None:
        rank.consumer.close()
        rank.consumer = None
    return m.Done()


def run_engine(rank: _Rank, cmd: m.RunEngine) -> m.Reply:
    """A decode rank's timed window: keep ``concurrency`` requests in flight until all are DONE.

    Each round is one decode step as vLLM's worker runs it: the requests that may start (up to ``per_step``
    and the free places in flight) start in one ``Consumer.start_reads`` call, then one poll collects
    results. Hook time: the start_reads calls and the polls that returned results, NIXL's calls timed apart
    (bench/hooks.py); the empty polls of the spin between steps are not counted (vLLM polls once a step).
    """
    from hybrid_transfer.bench.hooks import time_nixl_calls
    from hybrid_transfer.engine import Read, decode_ticket

    consumer = rank.consumer
    timer = time_nixl_calls(consumer)
    profiler = _window_profiler()
    queue = collections.deque((it.request_id, decode_ticket(it.ticket), it.local_block_ids, it.num_tokens)
                              for it in cmd.items)
    in_flight: dict[str, tuple[float, float, int]] = {}
    timings: list[RequestTiming] = []
    hook_s = hook_nixl_s = 0.0
    steps = 0
    _sleep_until(cmd.start_at)
    cpu0 = time.process_time()
    while queue or in_flight:
        # One step per round, then a poll: on CPU the copy may run inside the post, so posting the whole
        # window before the first poll would charge every request for its predecessors' copies.
        take = min(len(queue), cmd.per_step, cmd.concurrency - len(in_flight))
        if take > 0:
            step = [queue.popleft() for _ in range(take)]
            nixl0 = timer.spent
            t0 = time.monotonic()
            if profiler is not None:
                profiler.enable()
            errors = consumer.start_reads([Read(ticket, local_ids, num_tokens)
                                           for _, ticket, local_ids, num_tokens in step])
            if profiler is not None:
                profiler.disable()
            t1 = time.monotonic()
            hook_s, hook_nixl_s, steps = hook_s + t1 - t0, hook_nixl_s + timer.spent - nixl0, steps + 1
            for (rid, _, _, num_tokens), error in zip(step, errors, strict=True):
                if error is not None:
                    raise BenchError(f"start_reads refused: {type(error).__name__}: {error}", request_id=rid)
                in_flight[rid] = (t0, t1, num_tokens)
        nixl0 = timer.spent
        c0 = time.monotonic()
        if profiler is not None:
            profiler.enable()
        results = consumer.poll()
        if profiler is not None:
            profiler.disable()
        c1 = time.monotonic()
        if not results:
            _wait(rank.setup.poll_sleep_s)
            continue
        hook_s, hook_nixl_s = hook_s + c1 - c0, hook_nixl_s + timer.spent - nixl0
        for r in results:
            if not r.ok:
                raise BenchError(f"request ended {r.state.value}: {type(r.error).__name__}: {r.error}",
                                 request_id=r.request_id)
            t0, t1, num_tokens = in_flight.pop(r.request_id)
            # GB/s counts the valid payload for every variant: naive moves whole pages (page tails too),
            # and charging those would flatter it.
            payload = rank.planner.expected_bytes(num_tokens)
            timings.append(RequestTiming(
                r.request_id, t0, t1, r.finished_at, c1, payload, r.num_descriptors, (c1 - c0) / len(results),
                gather_s=r.gather_s, query_s=r.query_s, scatter_s=r.scatter_s,
                packed_sources=r.num_packed_sources, fallback_sources=r.num_fallback_sources,
                t_read_done=r.posted_at + r.read_s if r.read_s > 0 else 0.0))
    if profiler is not None:
        _WINDOWS[0] += 1
        config = consumer.config
        path = (f"{os.environ[PROFILE_ENV]}.rank{rank.setup.tp_rank}.window{_WINDOWS[0]}"
                f".{config.read_transport}-{config.mode.value}-{len(cmd.items)}")
        profiler.dump_stats(path)
        with open(f"{path}.gc", "w") as f:  # the garbage collector's passes in the window: they hit any call
            f.write(f"{_GC.report()}\n")
    return m.Ran(ConsumerRun(rank.setup.tp_rank, tuple(timings), time.process_time() - cpu0,
                             hook_s=hook_s, hook_nixl_s=hook_nixl_s, steps=steps))


_WINDOWS = [0]  # engine windows this process has profiled (PROFILE_ENV)


def _window_profiler():
    """A cProfile.Profile when PROFILE_ENV is set (every poll is profiled, empty ones too), else None."""
    if not os.environ.get(PROFILE_ENV):
        return None
    import cProfile
    import gc

    if _GC.callback not in gc.callbacks:
        gc.callbacks.append(_GC.callback)
    _GC.reset()
    return cProfile.Profile()


class _GcTimes:
    """Seconds and passes of the garbage collector per generation (gc.callbacks), for the profile's sidecar."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.seconds, self.passes, self._start = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            g = info["generation"]
            self.seconds[g] += time.perf_counter() - self._start
            self.passes[g] += 1

    def report(self) -> str:
        pairs = enumerate(zip(self.passes, self.seconds, strict=True))
        return " ".join(f"gen{g}: {n} passes {1e3 * t:.3f} ms" for g, (n, t) in pairs)


_GC = _GcTimes()


def plan_times(rank: _Rank, cmd: m.PlanTimes) -> m.Reply:
    """Plan each request again with the engine's Planner class (same ids, same mode), timed one by one."""
    from hybrid_transfer.plan.types import PackSourcePlan

    local_ids, remote_ids, num_tokens, plan_mode = cmd.local_ids, cmd.remote_ids, cmd.num_tokens, cmd.mode
    plan_s, descriptors, pieces = [], [], []
    cost = rank.consumer.cost_model  # auto: the engine's own (calibrated) choices
    rank.planner.plan(local_ids[0], remote_ids[0], num_tokens, plan_mode, cost=cost)  # fills the per-token cache
    for local, remote in zip(local_ids, remote_ids, strict=True):
        t0 = time.perf_counter()
        plan = rank.planner.plan(local, remote, num_tokens, plan_mode, cost=cost)
        plan_s.append(time.perf_counter() - t0)
        descriptors.append(plan.num_descriptors)
        pieces.append(sum(s.num_pieces if isinstance(s, PackSourcePlan) else s.num_descriptors
                          for s in plan.sources))
    return m.Planned(PlanTiming(rank.setup.tp_rank, tuple(plan_s), tuple(descriptors), tuple(pieces)))


def poison(rank: _Rank, cmd: m.Poison) -> m.Reply:
    from hybrid_transfer.verify import POISON_BYTE
    from hybrid_transfer.verify import poison as poison_cache

    poison_cache(rank.cache)
    if rank.ceiling is not None:
        rank.ceiling.buffer.fill_(POISON_BYTE)
    rank.sync()
    return m.Done()


def verify(rank: _Rank, cmd: m.Verify) -> m.Reply:
    """Every byte of the cache against the global-coordinate oracle (raises VerificationError).

    Naive moves whole attention pages like vLLM, so only for it the unused tail of a last page is skipped.
    """
    from hybrid_transfer.plan.types import PlanMode
    from hybrid_transfer.verify import check_destination_many

    rank.sync()
    check_destination_many(rank.cache, list(zip(cmd.layouts, cmd.seeds, strict=True)),
                           skip_attention_tails=rank.mode is PlanMode.NAIVE)
    return m.Done()


def ceiling_open(rank: _Rank, cmd: m.CeilingOpen) -> m.Reply:
    """This rank's ceiling agent and buffer; a prefill rank fills it and answers where it lies."""
    import secrets

    from hybrid_transfer.bench.ceiling import CeilingEnd, fill_pattern

    s = rank.setup
    name = f"{s.engine_id}-ceiling-{'p' if s.is_prefill else 'c'}{s.tp_rank}-{secrets.token_hex(4)}"
    rank.ceiling = CeilingEnd(name, s.engine_config(), cmd.slots, cmd.slot_bytes, rank.cache.device)
    if s.is_prefill:
        fill_pattern(rank.ceiling.buffer, cmd.seed)
        rank.sync()
        return m.CeilingBuffer(rank.ceiling.agent.metadata, rank.ceiling.base, rank.ceiling.device_id)
    return m.Done()


def ceiling_add_sources(rank: _Rank, cmd: m.CeilingAddSources) -> m.Reply:
    """The ceiling buffers of every prefill rank this rank reads."""
    for src in cmd.sources:
        rank.ceiling.add_source(src.rank, src.metadata, src.base, src.slot_bytes, src.device_id, src.seed)
    return m.Done()


def run_ceiling(rank: _Rank, cmd: m.RunCeiling) -> m.Reply:
    """A decode rank's ceiling window: per request one single-descriptor READ per source, ``concurrency`` deep."""
    from hybrid_transfer.engine.agent import XferState

    ceiling, lengths = rank.ceiling, cmd.lengths
    queue = collections.deque(cmd.request_ids)
    free_slots = collections.deque(range(ceiling.slots))
    in_flight: dict[str, tuple[float, float, int, list]] = {}
    timings: list[RequestTiming] = []
    num_bytes = sum(lengths.values())
    _sleep_until(cmd.start_at)
    cpu0 = time.process_time()
    while queue or in_flight:
        # One step per round, as in run_engine: up to per_step posts, then one check of everything in flight.
        for _ in range(min(len(queue), len(free_slots), cmd.per_step, cmd.concurrency - len(in_flight))):
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
            timings.append(RequestTiming(rid, t0, t1, c1, c1, num_bytes, len(handles), (c1 - c0) / len(finished),
                                         t_read_done=c1))
    return m.Ran(ConsumerRun(rank.setup.tp_rank, tuple(timings), time.process_time() - cpu0))


def ceiling_verify(rank: _Rank, cmd: m.CeilingVerify) -> m.Reply:
    rank.sync()
    for slot in range(cmd.slots_used):
        rank.ceiling.check_slot(slot, cmd.lengths)
    return m.Done()


def copy_open(rank: _Rank, cmd: m.CopyOpen) -> m.Reply:
    """The physical-limit buffers, one per source, on the source's GPU (cuda) and filled with its pattern."""
    import torch

    from hybrid_transfer.bench.ceiling import CopySource

    cuda = rank.setup.device is Device.CUDA
    rank.copy = CopySource(rank.ceiling, {
        s.rank: (s.nbytes, torch.device("cuda", s.gpu) if cuda else torch.device("cpu"), s.seed)
        for s in cmd.sources})
    rank.sync()
    return m.Done()


def run_copy(rank: _Rank, cmd: m.RunCopy) -> m.Reply:
    """A decode rank's physical-limit window: per request one torch copy per source, ``concurrency`` deep."""
    copy, lengths = rank.copy, cmd.lengths
    queue = collections.deque(cmd.request_ids)
    free_slots = collections.deque(range(copy.ceiling.slots))
    in_flight: dict[str, tuple[float, float, int, Any]] = {}
    timings: list[RequestTiming] = []
    num_bytes = sum(lengths.values())
    _sleep_until(cmd.start_at)
    cpu0 = time.process_time()
    while queue or in_flight:
        for _ in range(min(len(queue), len(free_slots), cmd.per_step, cmd.concurrency - len(in_flight))):
            rid, slot = queue.popleft(), free_slots.popleft()  # a step of posts per round, as in run_engine
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
            timings.append(RequestTiming(rid, t0, t1, c1, c1, num_bytes, len(lengths), (c1 - c0) / len(finished),
                                         t_read_done=c1))
    return m.Ran(ConsumerRun(rank.setup.tp_rank, tuple(timings), time.process_time() - cpu0))


def copy_verify(rank: _Rank, cmd: m.CopyVerify) -> m.Reply:
    rank.sync()
    for slot in range(cmd.slots_used):
        rank.copy.check_slot(slot, cmd.lengths)
    return m.Done()


# Every command a rank answers, by type (Stop and Shutdown are handled by the loops themselves).
HANDLERS: dict[type[m.Command], Callable[[_Rank, Any], m.Reply]] = {
    m.Setup: setup_rank,
    m.SetEngineAddresses: set_engine_addresses,
    m.Fill: fill,
    m.Hold: hold,
    m.Serve: serve,
    m.OpenConsumer: open_consumer,
    m.CloseConsumer: close_consumer,
    m.RunEngine: run_engine,
    m.PlanTimes: plan_times,
    m.Poison: poison,
    m.Verify: verify,
    m.CeilingOpen: ceiling_open,
    m.CeilingAddSources: ceiling_add_sources,
    m.RunCeiling: run_ceiling,
    m.CeilingVerify: ceiling_verify,
    m.CopyOpen: copy_open,
    m.RunCopy: run_copy,
    m.CopyVerify: copy_verify,
}


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


def worker_main(conn) -> None:
    """Command loop of one rank process: decode a command, run its handler, answer one reply (Failed on error)."""
    # Only the coordinator writes stdout (the table); UCX and NIXL's logger would print there too.
    os.dup2(2, 1)
    rank = _Rank(conn)
    try:
        while True:
            if conn.poll(IDLE_POLL_S):
                data = conn.recv_bytes()
                try:
                    cmd = m.decode_command(data)
                except msgspec.MsgspecError as exc:
                    conn.send_bytes(m.encode(m.Failed(type(exc).__name__, f"undecodable command: {exc}")))
                    continue
                if isinstance(cmd, m.Shutdown):
                    break
                if isinstance(cmd, m.Stop):  # a Serve that already failed and answered: nothing to stop
                    continue
                if isinstance(cmd, m.Setup):
                    level = cmd.rank.log_level.upper()
                    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
                    from hybrid_transfer.engine.agent import quiet_nixl_logging

                    quiet_nixl_logging(level)
                try:
                    reply = HANDLERS[type(cmd)](rank, cmd)
                except BaseException as exc:  # noqa: BLE001 - every failure goes back to the coordinator
                    log.debug("command %s failed", type(cmd).__name__, exc_info=True)
                    reply = m.Failed(type(exc).__name__, str(exc))
                conn.send_bytes(m.encode(reply))
            rank.poll_idle()
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        rank.close()
