"""The benchmark's parent process: spawn one process per rank, drive every phase, gather the timings.

Per point (one request shape), per round, per variant (chosen mode, naive, ceiling; the order rotates
each round and every figure comes from the variant's median-GB/s round):
  open    decode ranks build a Consumer in the variant's mode and handshake (engine variants)
  warmup  ``--warmup`` requests through the same path (first READs wire up UCX connections)
  poison  decode caches and ceiling buffers back to 0xA5 (with --verify)
  timed   prefill ranks hold every request (hold time recorded), enter ``serve``; decode ranks start
          together at a shared monotonic instant and keep ``--concurrency`` requests in flight, starting
          up to ``--per-step`` of them in one Consumer.start_reads call per round (a decode step)
  verify  every request against the global-coordinate oracle (with --verify), outside the window
  plan    each decode rank plans the same requests again, timed one by one (engine variants)
The coordinator passes block ids, tickets and results over pipes as typed messages (bench.messages);
it never touches NIXL. A token sweep starts fresh rank processes per point, sized to that point's tokens
(a 131,072-token point needs 16x an 8,192-token one); other runs share one set for every point.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from hybrid_transfer.bench import messages as m
from hybrid_transfer.bench import sizing, transport
from hybrid_transfer.bench.spec import BenchSpec, Device, Point, Sweep, Variant
from hybrid_transfer.bench.stats import (
    ConsumerRun,
    PlanTiming,
    ProducerServe,
    VariantStats,
    median_round,
    summarize,
)
from hybrid_transfer.bench.worker import worker_main
from hybrid_transfer.errors import BenchError, ConfigError, UnsupportedError

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 1800.0  # one command (a verify of a large cache on CPU takes minutes, not hours)
HANDSHAKE_TIMEOUT_S = 60.0
START_DELAY_S = 0.05  # decode ranks start together this long after the coordinator sends "run"
# When rank processes outnumber cores (10 ranks on a 2-core CI host), spinning decode ranks would starve the
# ones copying; they sleep this long between empty polls instead. With a core each, they spin.
CONTENDED_POLL_SLEEP_S = 50e-6
# Prefill ranks in a timed window: with a core each they spin too (every claim confirmation and Staged
# notification a request waits on passes through their poll). Contended, they sleep 1 ms: on the 2-core host,
# 50 us cost the producers 3-4x the CPU seconds and did not raise the P1 -> D1 or P2 -> D8 rows (docs/benchmarks.md).
CONTENDED_SERVE_SLEEP_S = 1e-3
MEMORY_HEADROOM = 0.85  # refuse a CPU run whose estimate exceeds this share of MemAvailable
DEVICE_HEADROOM = 0.92  # refuse a cuda run whose buffers on one GPU exceed this share of its memory
CUDA_IPC_VAR = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"

StepCallback = Callable[[str], None]
R = TypeVar("R", bound=m.Reply)


@dataclass(frozen=True)
class PointResult:
    point: Point
    payload_bytes_per_request: int
    stats: dict[str, VariantStats]  # Variant value -> figures


@dataclass
class BenchResult:
    spec: BenchSpec
    points: list[PointResult]
    memory: sizing.MemoryEstimate
    host: dict[str, Any]
    warnings: list[str] = field(default_factory=list)


class RankProcess:
    """One spawned rank process and its command pipe."""

    def __init__(self, ctx, name: str):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=worker_main, args=(child,), name=f"hybrid-transfer-bench-{name}",
                                   daemon=True)
        self.process.start()
        child.close()

    def send(self, cmd: m.Command) -> None:
        self.conn.send_bytes(m.encode(cmd))

    def recv(self, expected: type[R], timeout_s: float = CALL_TIMEOUT_S) -> R:
        """The answer to the last command, of type ``expected`` (BenchError for Failed or anything else)."""
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.5):
            if not self.process.is_alive():
                raise BenchError(f"process exited with code {self.process.exitcode}", where=self.name)
            if time.monotonic() >= deadline:
                raise BenchError(f"no answer within {timeout_s} s", where=self.name)
        try:
            data = self.conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise BenchError(f"process closed its pipe ({type(exc).__name__})", where=self.name) from exc
        return m.decode_reply(data, expected, self.name)

    def call(self, cmd: m.Command, expected: type[R]) -> R:
        self.send(cmd)
        return self.recv(expected)

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self.send(m.Shutdown())
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        self.conn.close()


def _all(procs: Sequence[RankProcess], cmd: m.Command, expected: type[R] = m.Done) -> list[R]:
    """The same command on every process at once; answers in process order."""
    for p in procs:
        p.send(cmd)
    return [p.recv(expected) for p in procs]


def check_engine_modes(spec: BenchSpec) -> None:
    """Refuse a mode the engine cannot execute yet, before any process starts."""
    from hybrid_transfer.engine.config import EngineConfig

    for variant in spec.variants:
        if variant.plan_mode is None:
            continue
        try:
            EngineConfig(mode=variant.plan_mode).validate()
        except ConfigError as exc:
            raise UnsupportedError(f"--mode {variant.value} is not yet supported by the engine ({exc}); "
                                   "run coalesced or naive") from exc


def cuda_environment() -> list[str]:
    """Make sure UCX may use cuda_ipc READs in the rank processes; return warnings for the user."""
    value = os.environ.get(CUDA_IPC_VAR)
    if value is None:
        os.environ[CUDA_IPC_VAR] = "y"
        return [f"{CUDA_IPC_VAR} was unset: set to y for the rank processes (without it UCX disables cuda_ipc "
                "READs on hosts without NVLink and moves GPU bytes over TCP at ~0.5 GB/s); export it yourself "
                "to silence this"]
    if value.strip().lower() not in ("y", "yes", "1", "on", "true"):
        return [f"{CUDA_IPC_VAR}={value}: cuda_ipc READs are disabled, so GPU bytes may move over TCP; "
                "set it to y for real figures"]
    return []


class Coordinator:
    """Runs one BenchSpec; ``on_step`` is called with a description after each step (progress bars)."""

    def __init__(self, spec: BenchSpec, on_step: StepCallback | None = None):
        self.spec = spec.validate()
        self.on_step = on_step or (lambda _desc: None)
        self._t0 = time.monotonic()
        self.warnings: list[str] = []
        self.producers: list[RankProcess] = []
        self.consumers: list[RankProcess] = []
        self.ceiling = sizing.ceiling_sizes(self.spec)  # the largest point's: what the memory checks judge
        self.memory = sizing.memory_estimate(self.spec, self.ceiling)
        self.sized = self.spec  # what the running rank processes were sized for (point_spec in a token sweep)
        self._secret_path: str | None = None  # the mapped path's secret file (_secret_file)
        self.sized_ceiling = self.ceiling

    @property
    def num_steps(self) -> int:
        s = self.spec
        per_engine = 4 + (1 if s.verify else 0)  # open, warmup, timed, plan (+ verify)
        per_ceiling = 2 + (1 if s.verify else 0)
        per_point = (1 if s.verify else 0) + s.rounds * sum(per_ceiling if v.plan_mode is None else per_engine
                                                            for v in s.variants)
        starts = len(s.points) if s.sweep is Sweep.TOKENS else 1
        return 2 * starts + per_point * len(s.points)

    def run(self) -> BenchResult:
        self._t0 = time.monotonic()
        check_engine_modes(self.spec)
        if self.spec.device is Device.CUDA:
            self.warnings += cuda_environment()
            self._check_device_memory()
        else:
            self._check_host_memory()
        for w in self.warnings:
            log.warning("%s", w)
        points = []
        if self.spec.sweep is Sweep.TOKENS:  # each point its own rank processes, caches sized to its tokens
            for i, p in enumerate(self.spec.points):
                try:
                    self._start(point_spec(self.spec, p))
                    points.append(self._run_point(i, p))
                finally:
                    self._close()
        else:
            try:
                self._start(self.spec)
                points = [self._run_point(i, p) for i, p in enumerate(self.spec.points)]
            finally:
                self._close()
        return BenchResult(self.spec, points, self.memory, _host_info(self.spec), self.warnings)

    def _step(self, description: str) -> None:
        log.info("%7.2f s  %s", time.monotonic() - self._t0, description)
        self.on_step(description)

    # ---- start-up -----------------------------------------------------------------------
    def _check_host_memory(self) -> None:
        available = sizing.available_host_bytes()
        if available is None or self.memory.total_bytes <= MEMORY_HEADROOM * available:
            return
        best = sizing.fitting_requests(self.spec, lambda t: sizing.memory_estimate(
            t, sizing.ceiling_sizes(t)).total_bytes <= MEMORY_HEADROOM * available)
        raise ConfigError(
            f"this run needs about {self.memory.total_bytes / 2**30:.1f} GiB (prefill rank "
            f"{self.memory.prefill_rank_bytes / 2**30:.2f} GiB, decode rank "
            f"{self.memory.decode_rank_bytes / 2**30:.2f} GiB with --verify's expected copy), "
            f"{available / 2**30:.1f} GiB are available: "
            + (f"use --requests {best} or fewer --tokens" if best else "no --requests fits: use fewer --tokens"),
            field="requests", value=self.spec.requests)

    def _check_device_memory(self) -> None:
        """Every GPU a rank lands on must hold its ranks' buffers (queried without creating a context)."""
        import torch

        if not torch.cuda.is_available():
            return  # the rank processes name the missing GPU (setup_rank)
        gpus = set(self.spec.prefill_gpus) | set(self.spec.decode_gpus)
        capacity = {g: torch.cuda.get_device_properties(g).total_memory for g in gpus
                    if g < torch.cuda.device_count()}
        sizing.check_device_memory(self.spec, capacity, DEVICE_HEADROOM)

    def _start(self, sized: BenchSpec) -> None:
        """Rank processes whose caches, ceiling slots, copy buffers and staging are sized for ``sized``."""
        s = self.sized = sized
        self.sized_ceiling = sizing.ceiling_sizes(sized)
        ctx = mp.get_context("spawn")
        with transport.rank_environment(s.transport):  # UCX reads it when each rank creates its agent
            self.producers = [RankProcess(ctx, f"prefill {r}") for r in range(s.prefill_tp)]
            self.consumers = [RankProcess(ctx, f"decode {r}") for r in range(s.decode_tp)]
        cores, num_ranks = os.cpu_count() or 1, s.prefill_tp + s.decode_tp
        threads = max(1, cores // num_ranks)
        poll_sleep_s = 0.0 if cores > num_ranks else CONTENDED_POLL_SLEEP_S
        serve_sleep_s = 0.0 if cores > num_ranks else CONTENDED_SERVE_SLEEP_S
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        prefill_id, decode_id = f"prefill-{secrets.token_hex(3)}", f"decode-{secrets.token_hex(3)}"
        incarnation = secrets.randbits(62)
        p_blocks, d_blocks = sizing.pool_blocks(s, True), sizing.pool_blocks(s, False)
        for side, procs in ((True, self.producers), (False, self.consumers)):
            for r, proc in enumerate(procs):
                proc.send(m.Setup(m.RankSetup(
                    preset=s.preset, kv_dtype=s.kv_dtype, is_prefill=side,
                    tp_size=s.prefill_tp if side else s.decode_tp, tp_rank=r,
                    num_blocks=p_blocks if side else d_blocks, device=s.device, gpu=s.gpu_of(side, r),
                    torch_threads=threads, engine_id=prefill_id if side else decode_id,
                    incarnation=incarnation if side else 0, mode=s.mode, log_level=level, poll_sleep_s=poll_sleep_s,
                    staging_bytes=sizing.staging_bytes(s, side), backend_threads=s.backend_threads,
                    kv_layout=s.kv_layout, split_batch_size=s.split_batch_size, post_thread=s.post_thread,
                    serve_sleep_s=serve_sleep_s, read_batching=s.read_batching,
                    secret_file=self._secret_file(), shared_cache=s.mapped)))
        started = [p.recv(m.Started) for p in self.producers]
        for c in self.consumers:
            c.recv(m.Done)
        self.addresses = [st.address for st in started]
        self.descriptors = [st.descriptor for st in started]
        if s.prefill_tp > 1:
            _all(self.producers, m.SetEngineAddresses(self.addresses))
        self._step("ranks started")
        self._open_ceiling()
        self._step("ceiling buffers ready")

    def _secret_file(self) -> str | None:
        """With the mapped path: a fresh secret in a 0600 file every rank reads (removed when the run ends)."""
        if not self.spec.mapped:
            return None
        if self._secret_path is None:
            fd, path = tempfile.mkstemp(prefix="ht-bench-secret-")
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
            self._secret_path = path
        return self._secret_path

    def _open_ceiling(self) -> None:
        from hybrid_transfer.plan.topology import Topology

        c = self.sized_ceiling
        seeds = [self.spec.seed * 31 + r + 1 for r in range(self.spec.prefill_tp)]
        for r, p in enumerate(self.producers):
            p.send(m.CeilingOpen(c.slots, c.src_slot_bytes[r], seeds[r]))
        buffers = [p.recv(m.CeilingBuffer) for p in self.producers]
        for d, proc in enumerate(self.consumers):
            proc.send(m.CeilingOpen(c.slots, c.dst_slot_bytes[d], 0))
        for proc in self.consumers:
            proc.recv(m.Done)
        for d, proc in enumerate(self.consumers):
            ranks = Topology(self.spec.prefill_tp, self.spec.decode_tp, d).sources
            proc.send(m.CeilingAddSources([
                m.CeilingSource(s, buffers[s].metadata, buffers[s].base, c.src_slot_bytes[s], buffers[s].device_id,
                                seeds[s])
                for s in ranks
            ]))
        for proc in self.consumers:
            proc.recv(m.Done)
        lengths = sizing.source_bytes(self.spec, max(p.tokens for p in self.sized.points))
        for d, proc in enumerate(self.consumers):
            proc.send(m.CopyOpen([m.CopySourceSpec(s, n, self.spec.gpu_of(True, s), seeds[s])
                                  for s, n in lengths[d].items()]))
        for proc in self.consumers:
            proc.recv(m.Done)

    def _close(self) -> None:
        for proc in self.consumers + self.producers:
            try:
                proc.close()
            except Exception as exc:  # noqa: BLE001 - keep closing the others
                log.warning("closing %s failed: %s", proc.name, exc)
        self.consumers, self.producers = [], []
        if self._secret_path is not None:
            os.unlink(self._secret_path)
            self._secret_path = None

    # ---- one point ----------------------------------------------------------------------
    def _run_point(self, index: int, point: Point) -> PointResult:
        s = self.spec
        p_layouts, c_layouts = sizing.layouts(self.sized, point, index)  # ids within this start's pools
        seeds = [sizing.request_seed(s, index, k) for k in range(s.requests)]
        if s.verify:
            _all(self.producers, m.Fill(p_layouts, seeds))
            self._step(f"point {index}: sources filled")
        lengths = sizing.source_bytes(s, point.tokens)
        rounds: dict[Variant, list[VariantStats]] = {v: [] for v in s.variants}
        for r in range(s.rounds):
            for variant in s.round_order(r):
                tag = f"p{index}-r{r}-{variant.value}"
                if variant is Variant.CEILING:
                    rounds[variant].append(self._run_ceiling(tag, lengths))
                elif variant is Variant.COPY:
                    rounds[variant].append(self._run_ceiling(tag, lengths, copy=True))
                else:
                    rounds[variant].append(self._run_engine(tag, point, variant, p_layouts, c_layouts, seeds))
        stats = {v.value: median_round(rs) for v, rs in rounds.items()}
        for name, st in stats.items():
            if st.fallback_sources:
                self.warnings.append(
                    f"point {index}, {name}: {st.fallback_sources} of {st.fallback_sources + st.packed_sources} "
                    "staged sources were read directly (staging absent or full): not a pure pack figure")
        payloads = {v: st.payload_bytes for v, st in stats.items()}
        if len(set(payloads.values())) != 1:
            raise BenchError(f"variants moved different bytes: {payloads}", where=f"point {index}")
        per_request = next(iter(payloads.values())) // s.requests
        return PointResult(point, per_request, stats)

    def _run_engine(self, tag: str, point: Point, variant: Variant, p_layouts, c_layouts,
                    seeds: list[int]) -> VariantStats:
        s = self.spec
        _all(self.consumers, m.OpenConsumer(variant.plan_mode, self.addresses[0], self.descriptors,
                                            HANDSHAKE_TIMEOUT_S, read_transport=variant.read_transport))
        self._step(f"{tag}: consumers connected")
        warm = min(s.warmup, s.requests)
        if warm:
            self._engine_phase(f"{tag}-warm", p_layouts[:warm], c_layouts[:warm])
        if s.verify:
            _all(self.consumers, m.Poison())
        self._step(f"{tag}: warmed up")
        runs, serves = self._engine_phase(tag, p_layouts, c_layouts)
        self._step(f"{tag}: timed")
        if s.verify:
            _all(self.consumers, m.Verify(c_layouts, seeds))
            self._step(f"{tag}: verified")
        planned = _all(self.consumers, m.PlanTimes([c.block_ids for c in c_layouts], [p.block_ids for p in p_layouts],
                                                   point.tokens, variant.plan_mode), m.Planned)
        plans: list[PlanTiming] = [p.timing for p in planned]
        _all(self.consumers, m.CloseConsumer())
        self._step(f"{tag}: planned again")
        return dataclasses.replace(summarize(variant.value, runs, serves, plans), verified=s.verify)

    def _engine_phase(self, tag: str, p_layouts, c_layouts) -> tuple[list[ConsumerRun], list[ProducerServe]]:
        from hybrid_transfer.engine import decode_ticket

        rids = [f"{tag}-{k}" for k in range(len(p_layouts))]
        held0 = self.producers[0].call(m.Hold(rids, p_layouts), m.Held)
        tickets = held0.tickets
        nonces = [decode_ticket(t).nonce for t in tickets]
        holds = [held0.hold_s] + [h.hold_s for h in _all(self.producers[1:], m.Hold(rids, p_layouts, nonces), m.Held)]
        items = [m.EngineItem(rid, t, c.block_ids, c.num_tokens) for rid, t, c in zip(rids, tickets, c_layouts,
                                                                                       strict=True)]
        runs, serves = self._timed(rids, lambda _d, start_at: m.RunEngine(items, self.spec.concurrency, start_at,
                                                                             per_step=self.spec.step_size))
        missing = {p.rank: sorted(set(rids) - p.freed_at.keys()) for p in serves if set(rids) - p.freed_at.keys()}
        if missing:
            raise BenchError(f"prefill ranks never freed these requests (lost notifications?): {missing}",
                             where=tag)
        serves = [msgspec.structs.replace(sv, hold_s=tuple(holds[sv.rank])) for sv in serves]
        return runs, serves

    def _timed(self, rids: list[str], command_of: Callable[[int, float], m.Command],
               ) -> tuple[list[ConsumerRun], list[ProducerServe]]:
        """Prefill ranks serve while decode rank d runs ``command_of(d, start_at)``, all from one instant."""
        for p in self.producers:
            p.send(m.Serve(rids))
        start_at = time.monotonic() + START_DELAY_S + 0.005 * len(self.consumers)
        try:
            for d, c in enumerate(self.consumers):
                c.send(command_of(d, start_at))
            runs = [c.recv(m.Ran).run for c in self.consumers]
        finally:
            for p in self.producers:
                try:
                    p.send(m.Stop())
                except (BrokenPipeError, OSError):
                    pass
        serves = [p.recv(m.Served).serve for p in self.producers]
        return runs, serves

    def _run_ceiling(self, tag: str, lengths: list[dict[int, int]], copy: bool = False) -> VariantStats:
        """The ceiling's READs, or with ``copy`` the physical limit's torch copies (same slots, same bytes)."""
        s = self.spec
        warm = min(s.warmup, s.requests)
        if warm:
            self._ceiling_phase([f"{tag}-warm-{k}" for k in range(warm)], lengths, copy)
        if s.verify:
            _all(self.consumers, m.Poison())
        self._step(f"{tag}: warmed up")
        runs, serves = self._ceiling_phase([f"{tag}-{k}" for k in range(s.requests)], lengths, copy)
        self._step(f"{tag}: timed")
        if s.verify:
            slots_used = min(self.sized_ceiling.slots, s.requests)
            check = m.CopyVerify if copy else m.CeilingVerify
            for d, proc in enumerate(self.consumers):
                proc.send(check(slots_used, lengths[d]))
            for proc in self.consumers:
                proc.recv(m.Done)
            self._step(f"{tag}: verified")
        variant = Variant.COPY if copy else Variant.CEILING
        return dataclasses.replace(summarize(variant.value, runs, serves), verified=s.verify)

    def _ceiling_phase(self, rids: list[str], lengths: list[dict[int, int]], copy: bool = False):
        run = m.RunCopy if copy else m.RunCeiling
        return self._timed([], lambda d, start_at: run(rids, lengths[d], self.spec.concurrency, start_at,
                                                      per_step=self.spec.step_size))


def point_spec(spec: BenchSpec, point: Point) -> BenchSpec:
    """The run reduced to one point: what a token sweep sizes that point's rank processes for."""
    return msgspec.structs.replace(spec, tokens=point.tokens, fragmentation=point.fragmentation, sweep=Sweep.NONE,
                                   sweep_values=())


def run_bench(spec: BenchSpec, on_step: StepCallback | None = None) -> BenchResult:
    """Run a benchmark end to end (spawns and closes its rank processes)."""
    return Coordinator(spec, on_step).run()


def _host_info(spec: BenchSpec) -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {"cpu_count": os.cpu_count(), "python": platform.python_version(),
                            "torch": torch.__version__, "platform": platform.platform()}
    try:
        from importlib.metadata import version

        info["nixl"] = version("nixl")
    except Exception:  # noqa: BLE001 - a version is nice to have, never required
        info["nixl"] = None
    if spec.device is Device.CUDA:
        info[CUDA_IPC_VAR] = os.environ.get(CUDA_IPC_VAR)
    info["ucx"] = transport.describe(spec.transport)
    return info
