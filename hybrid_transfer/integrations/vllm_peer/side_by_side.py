"""vLLM's NixlConnector and ours over the same caches and requests, in one run, on real NIXL.

This process is the prefill engine; a spawned process is the decode engine (each with its own
NIXL agent, loopback UCX, the same UCX threads and environment). For each connector in turn,
both engines are built from the same EngineShape (one KVCacheConfig from vLLM's planner, caches
from vLLM's ``allocate_kv_cache``, the source filled with the same seeded bytes), then the same
waves of requests run: every request of a wave is prefilled together, its kv_transfer_params go
to decode as a proxy forwards them, the decode engine loads them in one step and steps until
each has its first token. The wave fence (engine.py) gives both connectors the same block ids per
request on both sides; the run checks that, and each request's valid bytes on decode against the
source's (bytes_check.py).
"""

from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from dataclasses import dataclass, field

from hybrid_transfer.errors import BenchError, ConfigError
from hybrid_transfer.integrations.vllm_peer import pipe
from hybrid_transfer.integrations.vllm_peer.decode_host import WAVE_DEADLINE_S, WaveFigures, WaveRequest, host_main
from hybrid_transfer.integrations.vllm_peer.model import (
    CONNECTORS,
    DEVICES,
    HYBRID,
    HYBRID_PROGRESS,
    SSM_DTYPES,
    VLLM_NIXL,
    EngineShape,
    blocks_per_request,
    build_configs,
)

log = logging.getLogger(__name__)

CACHE_COPIES = 3  # prefill cache, decode cache, the decode process's regenerated source (always in host memory)
MEMORY_SHARE = 0.8  # of the free memory (host, or GPU 0's) the caches may take
CUDA_IPC_VAR = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"  # without =y UCX moves GPU bytes over TCP (docs/tuning.md#cuda-ipc)
CREATE_TIMEOUT_S = 300.0  # the decode process imports vLLM first (10-60 s on a loaded 2-core host)
# What the toy proxy of vLLM's NIXL tests sends the prefill engine (both connectors read do_remote_decode).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}


@dataclass(frozen=True)
class PeerSpec:
    """One side-by-side run: every connector moves ``warmup + waves`` waves of ``concurrency`` requests."""

    preset: str = "qwen3.5-0.8b"
    tokens: int = 1024  # tokens whose KV moves per request (prompt: tokens + 1)
    concurrency: int = 4  # requests per wave, loaded in one decode step
    waves: int = 3  # timed waves
    rounds: int = 1  # every connector runs once per round, the order rotating; figures are medians over all waves
    warmup: int = 1  # untimed waves first (handshakes, first READs)
    num_threads: int = 0  # UCX thread-pool threads of every agent, both connectors
    seed: int = 0
    connectors: tuple[str, ...] = CONNECTORS
    device: str = "cpu"  # where both engines' caches live: "cpu" (DRAM) or "cuda" (GPU 0, both processes)
    ssm_dtype: str | None = None  # both engines' SSM state dtype (EngineShape.ssm_dtype); None: the preset's

    def shape(self, num_blocks: int) -> EngineShape:
        """The EngineShape of this run with a pool of ``num_blocks`` blocks."""
        return EngineShape(self.preset, self.tokens, num_blocks=num_blocks, max_num_seqs=self.concurrency,
                           num_threads=self.num_threads, device=self.device, ssm_dtype=self.ssm_dtype)

    def validate(self) -> PeerSpec:
        for name, low in (("tokens", 1), ("concurrency", 1), ("waves", 1), ("rounds", 1), ("warmup", 1),
                          ("num_threads", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or value < low:
                raise ConfigError(f"{name}={value!r}: must be an integer >= {low}", field=name, value=value)
        unknown = [c for c in self.connectors if c not in CONNECTORS]
        if unknown or not self.connectors:
            raise ConfigError(f"connectors {list(self.connectors)!r}: pick from {', '.join(CONNECTORS)}",
                              field="connectors", value=self.connectors)
        if self.device not in DEVICES:
            raise ConfigError(f"device {self.device!r}: pick from {', '.join(DEVICES)}", field="device",
                              value=self.device)
        if self.ssm_dtype is not None and self.ssm_dtype not in SSM_DTYPES:
            raise ConfigError(f"ssm_dtype {self.ssm_dtype!r}: pick from {', '.join(SSM_DTYPES)}", field="ssm_dtype",
                              value=self.ssm_dtype)
        return self


@dataclass
class ConnectorResult:
    """One connector's figures: the timed waves seen by decode, the producer's share, every request's ids."""

    connector: str
    concurrency: int
    waves: list[WaveFigures] = field(default_factory=list)
    producer_hooks_s: list[float] = field(default_factory=list)  # per timed wave, prefill worker's two hooks
    producer_cpu_s: list[float] = field(default_factory=list)
    source_ids: dict[str, tuple] = field(default_factory=dict)  # "w{wave}-r{i}" -> prefill ids, every wave

    def _per_request_ms(self, seconds: list[float]) -> float:
        return statistics.median(s / self.concurrency for s in seconds) * 1e3

    def worker_ms_range(self) -> tuple[float, float]:
        """(min, max) over the timed waves of ``worker_ms``'s per-wave value."""
        per_wave = [(w.start_s + w.results_s) / self.concurrency * 1e3 for w in self.waves]
        return min(per_wave), max(per_wave)

    @property
    def worker_ms(self) -> float:
        """Decode worker thread inside start_load_kv + get_transfer_results per request (median wave)."""
        return self._per_request_ms([w.start_s + w.results_s for w in self.waves])

    @property
    def nixl_ms(self) -> float:
        """Of ``worker_ms``, the time inside NIXL's agent calls (the rest is the connector's own Python)."""
        return self._per_request_ms([w.nixl_s for w in self.waves])

    @property
    def descriptors_per_request(self) -> float:
        return statistics.median(w.descriptors / self.concurrency for w in self.waves)

    @property
    def start_ms(self) -> float:
        return self._per_request_ms([w.start_s for w in self.waves])

    @property
    def producer_ms(self) -> float:
        return self._per_request_ms(self.producer_hooks_s)

    def _latencies_ms(self) -> list[float]:
        return sorted(r.post_s * 1e3 for w in self.waves for r in w.requests)

    @property
    def p50_ms(self) -> float:
        return statistics.median(self._latencies_ms())

    @property
    def p99_ms(self) -> float:
        lat = self._latencies_ms()
        return lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]

    @property
    def gbps(self) -> float:
        return statistics.median(sum(r.nbytes for r in w.requests) / w.window_s / 1e9 for w in self.waves)

    @property
    def steps(self) -> float:
        return statistics.median(w.num_steps for w in self.waves)

    @property
    def cpu_ms(self) -> tuple[float, float]:
        return (self._per_request_ms([w.cpu_s for w in self.waves]), self._per_request_ms(self.producer_cpu_s))

    def merge(self, other: ConnectorResult) -> None:
        """Add another round of the same connector; its requests must have had the same ids and bytes."""
        mine, theirs = self.request_map(), other.request_map()
        changed = sorted(k for k in mine if theirs.get(k) != mine[k])
        if changed:
            raise BenchError(f"{self.connector}: requests {changed} differ between rounds (ids or bytes)",
                             where="rounds")
        self.waves += other.waves
        self.producer_hooks_s += other.producer_hooks_s
        self.producer_cpu_s += other.producer_cpu_s

    def request_map(self) -> dict[str, tuple]:
        """Timed request key -> (prefill ids, decode ids, valid bytes, sha256 of them)."""
        out = {}
        for w in self.waves:
            for r in w.requests:
                key = r.request_id.removeprefix("d-")
                out[key] = (self.source_ids[key], r.block_ids, r.nbytes, r.digest)
        return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _DecodeProcess:
    """The spawned decode engine process and its command pipe."""

    def __init__(self, env: dict[str, str]):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        env = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **env}
        self.process = ctx.Process(target=host_main, args=(child, env), name="vllm-peer-decode", daemon=True)
        self.process.start()

    def send(self, op: str, *args) -> None:
        self.conn.send((op, args))

    def ready(self) -> bool:
        return self.conn.poll(0)

    def recv(self, timeout_s: float):
        try:
            if not self.conn.poll(timeout_s):
                raise BenchError(f"no answer within {timeout_s} s", where="decode")
            status, value = self.conn.recv()
        except (EOFError, OSError) as exc:
            raise BenchError(f"the decode process died (exit code {self.process.exitcode})", where="decode") from exc
        if status == "err":
            raise BenchError(value, where="decode")
        return value

    def close(self) -> None:
        pipe.close(self.process, self.conn)


def engine_shape(spec: PeerSpec) -> EngineShape:
    """The shape both engines of both connectors share; the pool holds one wave (the fence frees it whole).

    A wave's blocks stay under our producer's default cap on held blocks (90% of the cache), so both
    connectors run on their defaults.
    """
    _, kvc = build_configs(VLLM_NIXL, "kv_both", spec.shape(16))
    num_blocks = -(-blocks_per_request(kvc, spec.tokens) * spec.concurrency * 10 // 9) + 2
    shape = spec.shape(num_blocks)
    # The caches held at once: prefill, decode and the decode process's copy of the source (in host memory).
    cache_bytes = sum(t.size for t in build_configs(VLLM_NIXL, "kv_both", shape)[1].kv_cache_tensors)
    for where, copies, available in _free_memory(spec.device):
        if copies * cache_bytes > MEMORY_SHARE * available:
            raise ConfigError(f"{spec.concurrency} requests of {spec.tokens} tokens need {copies} caches of "
                              f"{cache_bytes / 2**30:.1f} GiB in {where}, which has {available / 2**30:.1f} GiB "
                              "free: lower --tokens or --concurrency", field="concurrency", value=spec.concurrency)
    return shape


def _free_memory(device: str) -> list[tuple[str, int, int]]:
    """(where, cache copies it holds, free bytes) for each memory the caches take on ``device``."""
    host = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if device != "cuda":
        return [("this host's memory", CACHE_COPIES, host)]
    import torch

    free, _ = torch.cuda.mem_get_info(0)
    return [("GPU 0", CACHE_COPIES - 1, free), ("this host's memory", 1, host)]


def _prefill_wave(p, keys: list[str], num_prompt_tokens: int, deadline: float) -> dict[str, tuple[dict, tuple]]:
    """Prefill a wave together; return key -> (params as a proxy forwards them, prefill block ids)."""
    p.fence = {f"p-{k}" for k in keys}
    for k in keys:
        p.add(f"p-{k}", num_prompt_tokens, dict(PREFILL_PARAMS))
    out: dict[str, tuple[dict, tuple]] = {}
    while len(out) < len(keys):
        if time.monotonic() > deadline:
            raise BenchError(f"prefill of {sorted(set(keys) - set(out))} not done in time", where="prefill")
        for rid, o in p.step().items():
            if o.kv_transfer_params is None:
                raise BenchError(f"{rid} finished ({o.finish_reason}) without kv_transfer_params", where="prefill")
            out[rid.removeprefix("p-")] = (json.loads(json.dumps(o.kv_transfer_params)),
                                           tuple(tuple(g) for g in p.block_ids(rid)))
    return out


def _run_connector(connector: str, spec: PeerSpec, shape: EngineShape, decode: _DecodeProcess) -> ConnectorResult:
    from hybrid_transfer.integrations.vllm_peer.engine import PeerEngine

    t0 = time.monotonic()
    decode.send("create", connector, shape, spec.seed)
    p = PeerEngine(connector, "kv_producer", shape, seed=spec.seed)
    try:
        log.info("%s: prefill engine built in %.1f s", connector, time.monotonic() - t0)
        decode.recv(CREATE_TIMEOUT_S)
        log.info("%s: decode engine built after %.1f s", connector, time.monotonic() - t0)
        result = ConnectorResult(connector, spec.concurrency)
        for w in range(spec.warmup + spec.waves):
            keys = [f"w{w}-r{i}" for i in range(spec.concurrency)]
            deadline = time.monotonic() + WAVE_DEADLINE_S
            prefilled = _prefill_wave(p, keys, spec.tokens + 1, deadline)
            hooks0 = sum(p.times.start_s) + sum(p.times.results_s)
            cpu0 = time.process_time()
            decode.send("wave", [WaveRequest(f"d-{k}", spec.tokens + 1, params, ids)
                                 for k, (params, ids) in prefilled.items()])
            while not decode.ready():  # the prefill engine keeps stepping: it serves the reads and frees
                if time.monotonic() > deadline:
                    raise BenchError(f"wave {w} not loaded in time", where="prefill")
                p.step()
            figures = decode.recv(0)
            while not p.is_idle():
                if time.monotonic() > deadline:
                    raise BenchError(f"wave {w}: prefill blocks not freed in time", where="prefill")
                p.step()
            for k, (_, ids) in prefilled.items():
                result.source_ids[k] = ids
            log.info("%s: wave %d done after %.1f s", connector, w, time.monotonic() - t0)
            if w >= spec.warmup:
                result.waves.append(figures)
                result.producer_hooks_s.append(sum(p.times.start_s) + sum(p.times.results_s) - hooks0)
                result.producer_cpu_s.append(time.process_time() - cpu0)
        return result
    finally:
        p.shutdown()
        if decode.process.is_alive():
            decode.send("close")
            decode.recv(CREATE_TIMEOUT_S)


def run_side_by_side(spec: PeerSpec) -> list[ConnectorResult]:
    """Run every connector of ``spec`` over the same shape, seed and waves; return their results in order.

    Raises:
        ConfigError: a bad spec, before any process starts.
        BenchError: a wave that did not finish, a failed load, bytes that differ (the VerificationError's text).
    """
    spec.validate()
    shape = engine_shape(spec)
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}
    if spec.device == "cuda" and CUDA_IPC_VAR not in os.environ:
        log.warning("%s was unset: set to y for both engines' agents (GPU bytes would go over TCP)", CUDA_IPC_VAR)
        env[CUDA_IPC_VAR] = "y"
    decode = _DecodeProcess(env)
    here = {**env, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_free_port())}  # this process: its own side-channel port
    saved = {k: os.environ.get(k) for k in here}
    os.environ.update(here)
    try:
        merged: dict[str, ConnectorResult] = {}
        for round_index in range(spec.rounds):
            k = round_index % len(spec.connectors)
            for connector in spec.connectors[k:] + spec.connectors[:k]:  # rotate: no connector always goes first
                result = _run_connector(connector, spec, shape, decode)
                if connector in merged:
                    merged[connector].merge(result)
                else:
                    merged[connector] = result
        return [merged[c] for c in spec.connectors]
    finally:
        decode.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def same_requests(results: list[ConnectorResult]) -> list[str]:
    """Differences between the connectors' runs: block ids on either side, valid byte counts or digests."""
    if len(results) < 2:
        return []
    first, problems = results[0].request_map(), []
    for other in results[1:]:
        theirs = other.request_map()
        if set(theirs) != set(first):
            problems.append(f"{other.connector}: requests {sorted(set(theirs) ^ set(first))} differ")
        for key in sorted(set(theirs) & set(first)):
            for what, a, b in zip(("prefill ids", "decode ids", "valid bytes", "digest"), first[key], theirs[key],
                                  strict=True):
                if a != b:
                    problems.append(f"{key}: {what} {results[0].connector}={a} {other.connector}={b}")
    return problems


COLUMNS = ("connector", "GB/s", "/ceiling", "/naive", "desc/req", "plan ms", "post ms", "ovh ms", "p50 ms",
           "p99 ms", "lag ms", "hold ms", "gather/scatter ms", "CPU ms/req d/p", "steps", "prefill ms/req",
           "NIXL ms/req", "verified")
NOTES = (
    "Columns as in `hybrid-transfer bench` ('-': not measured for a connector driven through vLLM's hooks). "
    "desc/req: local descriptors of the transfers created inside the hooks, per request (NIXL's "
    "make_prepped_xfer indices or initialize_xfer list). GB/s: valid bytes of a wave / (start_load_kv of the "
    "step that carried its loads -> the last "
    "get_transfer_results reporting one), median wave. post ms: inside start_load_kv per request. ovh ms: the "
    "decode worker thread inside start_load_kv + get_transfer_results over every step of the wave, per request "
    "(the engine steps back to back, so waiting polls count). p50/p99 ms: start_load_kv entry -> the "
    "get_transfer_results naming the request. CPU ms/req: process CPU over the wave per request, decode / "
    "prefill (the prefill process also orchestrates). steps: decode steps per wave. prefill ms/req: the prefill "
    "worker's two hooks per request. NIXL ms/req: of ovh ms, inside NIXL agent calls on the worker's thread "
    "(ovh minus this is the connector's own Python). ovh ms (min-max): over all timed waves. verified: every request's valid bytes equal the source's."
)


def table_rows(results: list[ConnectorResult]) -> list[list[str]]:
    rows = []
    for r in results:
        cpu_d, cpu_p = r.cpu_ms
        rows.append([r.connector, f"{r.gbps:.2f}", "-", "-", f"{r.descriptors_per_request:.1f}", "-",
                     f"{r.start_ms:.3f}",
                     "{:.3f} ({:.2f}-{:.2f})".format(r.worker_ms, *r.worker_ms_range()),
                     f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", "-", "-", "-", f"{cpu_d:.2f} / {cpu_p:.2f}",
                     f"{r.steps:g}", f"{r.producer_ms:.3f}", f"{r.nixl_ms:.3f}", "yes"])
    return rows


def plain_table(spec: PeerSpec, results: list[ConnectorResult]) -> str:
    head = (f"{spec.preset}, P1 -> D1, {spec.tokens} tokens, {spec.concurrency} requests per wave, {spec.waves} "
            f"timed waves (+{spec.warmup} warm-up) x {spec.rounds} round(s), UCX threads {spec.num_threads}, "
            f"{'GPU 0 VRAM, prefill and decode processes on one GPU' if spec.device == 'cuda' else 'CPU DRAM'}, "
            f"{spec.shape(1).mamba_ssm_cache_dtype} SSM state, loopback")
    rows = [list(COLUMNS)] + table_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [head, ""] + ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines + ["", NOTES])


def to_json(spec: PeerSpec, results: list[ConnectorResult]) -> dict:
    return {
        "spec": {k: getattr(spec, k) for k in spec.__dataclass_fields__},
        "connectors": [{
            "connector": r.connector, "gbps": r.gbps, "post_ms": r.start_ms, "worker_ms_per_request": r.worker_ms,
            "p50_ms": r.p50_ms, "p99_ms": r.p99_ms, "cpu_ms_per_request_decode": r.cpu_ms[0],
            "cpu_ms_per_request_prefill": r.cpu_ms[1], "steps_per_wave": r.steps,
            "prefill_worker_ms_per_request": r.producer_ms, "nixl_ms_per_request": r.nixl_ms,
            "descriptors_per_request": r.descriptors_per_request, "verified": True,
        } for r in results],
        "same_requests": not same_requests(results),
    }


__all__ = ["CONNECTORS", "HYBRID", "HYBRID_PROGRESS", "VLLM_NIXL", "ConnectorResult", "PeerSpec", "plain_table", "run_side_by_side", "same_requests",
           "to_json"]
