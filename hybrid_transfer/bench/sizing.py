"""How big everything is: block pools, request layouts, ceiling slots and the memory a run needs.

Pure arithmetic in the coordinator, before any process starts, so a run that cannot fit fails
with the numbers instead of half-way through.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from hybrid_transfer.bench import vllm_pool
from hybrid_transfer.bench.spec import BenchSpec, Point
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import LayerKind, RankGeometry, load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, fake_engine, make_block_ids
from hybrid_transfer.plan.topology import Topology
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout, make_requests


def geometry(spec: BenchSpec, is_prefill: bool, tp_rank: int = 0) -> RankGeometry:
    tp = spec.prefill_tp if is_prefill else spec.decode_tp
    return RankGeometry(load_preset(spec.preset), tp, tp_rank, spec.cache_options)


def blocks_per_request(geo: RankGeometry, num_tokens: int) -> int:
    """ceil(n / B) per attention group plus one per GDN group (the request model)."""
    need = geo.num_blocks_for_tokens(num_tokens)
    return sum(need if g.kind is LayerKind.ATTENTION else 1 for g in geo.tensor_map.groups)


def pool_blocks(spec: BenchSpec, is_prefill: bool) -> int:
    """Blocks per shared tensor on one side: every request of the largest point, disjoint (verify checks all);
    with vllm-pool, vLLM's null block and twice the requests live (bench/vllm_pool.py)."""
    geo = geometry(spec, is_prefill)
    if spec.allocation == "vllm-pool":
        return max(vllm_pool.bench_pool_blocks(geo, p.tokens, spec.requests) for p in spec.points)
    return max(1, max(spec.requests * blocks_per_request(geo, p.tokens) for p in spec.points))


def staging_bytes(spec: BenchSpec, is_prefill: bool) -> int:
    """Staging pool of one rank for pack and auto, so no request falls back to direct for lack of room.

    A producer rank gathers every request it holds (the bench holds all of a point's requests at once);
    a decode rank stages the requests it has in flight. Bytes are the rank's real bytes per request.
    """
    geo = geometry(spec, is_prefill)
    num_fa = geo.num_attention_layers
    per_request = max(p.tokens * geo.kv_bytes_per_token * num_fa + geo.state_bytes_per_request for p in spec.points)
    held = spec.requests if is_prefill else min(spec.requests, spec.concurrency)
    return max(1 << 20, held * per_request + (1 << 20))


def request_seed(spec: BenchSpec, point_index: int, request_index: int) -> int:
    """Pattern seed of one request: producers fill with it, consumers check against it."""
    return (spec.seed * 1_000_003 + point_index) * 100_003 + request_index


def layouts(spec: BenchSpec, point: Point, point_index: int) -> tuple[list[RequestLayout], list[RequestLayout]]:
    """(producer layouts, consumer layouts) of a point's requests: disjoint ids on each side.

    Every rank of one engine uses the same ids (the request model); the two sides draw theirs
    independently, each with the point's fragmentation or its own vllm-pool churn.
    """
    rng = np.random.default_rng([spec.seed, point_index])
    if spec.allocation == "vllm-pool":  # each side its own churn, seeds drawn from the point's stream
        seed_p, seed_d = (int(x) for x in rng.integers(0, 2**63 - 1, size=2))
        return (vllm_pool.pool_layouts(geometry(spec, True), point.tokens, spec.requests, pool_blocks(spec, True), seed_p),
                vllm_pool.pool_layouts(geometry(spec, False), point.tokens, spec.requests, pool_blocks(spec, False),
                                       seed_d))
    counts = [point.tokens] * spec.requests
    producer = make_requests(geometry(spec, True), counts, pool_blocks(spec, True), rng, point.fragmentation)
    consumer = make_requests(geometry(spec, False), counts, pool_blocks(spec, False), rng, point.fragmentation)
    return producer, consumer


def source_bytes(spec: BenchSpec, num_tokens: int) -> list[dict[int, int]]:
    """Per decode rank: bytes of one request it reads from each source rank (what the ceiling moves).

    Planned over fake engines, so it is the planner's own count, not a second formula.
    """
    model = load_preset(spec.preset)
    opts = spec.cache_options
    probe_p = fake_engine(model, spec.prefill_tp, opts, 1)[0]
    probe_d = fake_engine(model, spec.decode_tp, opts, 1)[0]
    counts_p = blocks_needed(model, probe_p.block_size, num_tokens)
    counts_d = blocks_needed(model, probe_d.block_size, num_tokens)
    pool_p, pool_d = max(1, sum(counts_p)), max(1, sum(counts_d))
    producers = fake_engine(model, spec.prefill_tp, opts, pool_p, engine_index=0)
    consumers = fake_engine(model, spec.decode_tp, opts, pool_d, engine_index=1)
    rng = np.random.default_rng(0)
    remote_ids = make_block_ids(counts_p, pool_p, 0.0, rng)
    local_ids = make_block_ids(counts_d, pool_d, 0.0, rng)
    out = []
    for d in range(spec.decode_tp):
        plan = Planner(model, consumers[d], producers).plan(local_ids, remote_ids, num_tokens, PlanMode.COALESCED)
        per_source = dict.fromkeys(Topology(spec.prefill_tp, spec.decode_tp, d).sources, 0)
        for src in plan.sources:
            per_source[src.source_rank] += src.total_bytes
        out.append(per_source)
    return out


@dataclass(frozen=True)
class CeilingSizes:
    """Ceiling buffers: ``slots`` slots per rank so concurrent reads never share bytes.

    Producer rank s: ``slots`` slots of ``src_slot_bytes[s]``. Decode rank d: ``slots`` slots of
    ``dst_slot_bytes[d]``, each holding one segment per source of d (bytes per source: the largest
    point's ``source_bytes``).
    """

    slots: int
    src_slot_bytes: tuple[int, ...]
    dst_slot_bytes: tuple[int, ...]


def ceiling_sizes(spec: BenchSpec) -> CeilingSizes:
    largest = max(spec.points, key=lambda p: p.tokens).tokens
    per_rank = source_bytes(spec, largest)
    src = [0] * spec.prefill_tp
    for per_source in per_rank:
        for s, n in per_source.items():
            src[s] = max(src[s], n)
    slots = min(spec.concurrency, spec.requests)
    return CeilingSizes(slots, tuple(max(1, n) for n in src), tuple(max(1, sum(p.values())) for p in per_rank))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes each rank process holds (its base, caches, verification clone, ceiling buffers, pack staging)."""

    prefill_rank_bytes: int
    decode_rank_bytes: int
    total_bytes: int


PROCESS_BASE_BYTES = 320 << 20  # a rank process before its caches: Python, torch, NIXL, UCX (~240 MiB measured)
CUDA_CONTEXT_BYTES = 640 << 20  # per rank process on its GPU: the CUDA context and torch's allocator slack


def _buffer_bytes(spec: BenchSpec, ceiling: CeilingSizes) -> tuple[int, int, int]:
    """(prefill rank, decode rank, decode rank's physical-limit copy) bytes of buffers, without the process base."""
    gp, gd = geometry(spec, True), geometry(spec, False)
    cache_p = gp.num_tensors * gp.page_bytes * pool_blocks(spec, True)
    cache_d = gd.num_tensors * gd.page_bytes * pool_blocks(spec, False)
    clone = 2 if spec.verify else 1  # check_destination_many builds the expected cache beside the real one
    p = cache_p + ceiling.slots * max(ceiling.src_slot_bytes)
    d = cache_d * clone + ceiling.slots * max(ceiling.dst_slot_bytes)
    copy = max(ceiling.dst_slot_bytes)  # one request's bytes per source for the physical-limit copy (ceiling.py)
    if spec.mode in (PlanMode.PACK, PlanMode.AUTO):  # staging pools exist in these modes only
        p += staging_bytes(spec, True)
        d += staging_bytes(spec, False)
    return p, d, copy


def memory_estimate(spec: BenchSpec, ceiling: CeilingSizes) -> MemoryEstimate:
    p, d, copy = _buffer_bytes(spec, ceiling)
    p += PROCESS_BASE_BYTES
    d += PROCESS_BASE_BYTES + copy
    return MemoryEstimate(p, d, p * spec.prefill_tp + d * spec.decode_tp)


def device_bytes(spec: BenchSpec, ceiling: CeilingSizes) -> dict[int, int]:
    """GPU index -> bytes the rank processes allocate on it (--device cuda): caches, the verification copy,
    ceiling slots, pack staging, each process's CUDA context; a decode rank's physical-limit copy buffers lie
    on its sources' GPU."""
    p, d, copy = _buffer_bytes(spec, ceiling)
    out: dict[int, int] = {}
    for r in range(spec.prefill_tp):
        g = spec.gpu_of(True, r)
        out[g] = out.get(g, 0) + p + CUDA_CONTEXT_BYTES
    for r in range(spec.decode_tp):
        g = spec.gpu_of(False, r)
        out[g] = out.get(g, 0) + d + CUDA_CONTEXT_BYTES
        src = spec.gpu_of(True, Topology(spec.prefill_tp, spec.decode_tp, r).sources[0])
        out[src] = out.get(src, 0) + copy
    return out


def fitting_requests(spec: BenchSpec, fits) -> int:
    """The most requests (at most ``spec.requests``) for which ``fits(spec with that many)`` holds; 0 if none."""
    lo, hi = 0, spec.requests
    while lo < hi:
        mid = (lo + hi + 1) // 2
        trial = msgspec.structs.replace(spec, requests=mid)
        if fits(trial):
            lo = mid
        else:
            hi = mid - 1
    return lo


def check_device_memory(spec: BenchSpec, capacity_bytes: dict[int, int], headroom: float) -> None:
    """Refuse a --device cuda run whose buffers cannot fit its GPUs, before any process allocates.

    Raises:
        ConfigError: names the GPU, its need and capacity, the largest point's tokens and the
            --requests that would fit.
    """
    def over(trial: BenchSpec) -> list[tuple[int, int, int]]:
        need = device_bytes(trial, ceiling_sizes(trial))
        return [(g, n, capacity_bytes[g]) for g, n in sorted(need.items())
                if g in capacity_bytes and n > headroom * capacity_bytes[g]]

    bad = over(spec)
    if not bad:
        return
    g, need, cap = bad[0]
    most = max(p.tokens for p in spec.points)
    best = fitting_requests(spec, lambda t: not over(t))
    hint = (f"use --requests {best} (or fewer --tokens, or spread ranks with --prefill-gpus / --decode-gpus)"
            if best else "no --requests fits: use fewer --tokens, drop --verify, or spread ranks over more GPUs")
    raise ConfigError(
        f"GPU {g} would hold about {need / 2**30:.1f} GiB ({spec.requests} requests of {most:,} tokens on each side"
        f"{', with --verify' if spec.verify else ''}, ceiling and copy buffers, one CUDA context per rank), "
        f"more than {headroom:.0%} of its {cap / 2**30:.1f} GiB: {hint}",
        field="requests", value=spec.requests)


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None
