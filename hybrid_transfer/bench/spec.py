"""What one benchmark run measures: the typed, validated description the CLI builds from its flags."""

from __future__ import annotations

import enum
from typing import ClassVar

import msgspec

from hybrid_transfer.engine.config import READ_BATCHING, READ_TRANSPORTS
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import CacheOptions, DType, KVLayout, load_preset
from hybrid_transfer.layout.model import context_tokens
from hybrid_transfer.layout.presets import preset_config
from hybrid_transfer.plan.types import PlanMode

KV_DTYPES = {"bf16": DType.BF16, "fp16": DType.FP16, "fp8": DType.FP8}
DEFAULT_SWEEP_VALUES = {
    "fragmentation": (0.0, 0.25, 0.5, 0.75, 1.0),
    "tokens": (512, 1024, 2048, 4096, 8192),
}


class Device(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"


class Sweep(enum.Enum):
    NONE = "none"
    FRAGMENTATION = "fragmentation"
    TOKENS = "tokens"


class Variant(enum.Enum):
    """What a timed phase moves: the engine in one plan mode, the single-descriptor ceiling, or COPY: a
    torch device copy of the same bytes inside each decode process (the memory's own limit, no NIXL)."""

    COALESCED = "coalesced"
    NAIVE = "naive"
    PACK = "pack"
    AUTO = "auto"
    CEILING = "ceiling"
    COPY = "copy"
    # Over a mapping of the producer's cache (engine/mapped/; --read-transport auto or mapped): direct reads,
    # and auto planning with the mapped path's cost preset.
    MAPPED = "mapped"
    MAPPED_AUTO = "mapped-auto"

    @property
    def plan_mode(self) -> PlanMode | None:
        if self in (Variant.CEILING, Variant.COPY):
            return None
        return {Variant.MAPPED: PlanMode.COALESCED, Variant.MAPPED_AUTO: PlanMode.AUTO}.get(self) or PlanMode(self.value)

    @property
    def read_transport(self) -> str:
        """EngineConfig.read_transport of this variant's consumers."""
        return "mapped" if self in (Variant.MAPPED, Variant.MAPPED_AUTO) else "nixl"


class Point(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One sweep point: the request shape every variant of it moves."""

    tokens: int
    fragmentation: float


class BenchSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A benchmark run; see ``hybrid-transfer bench --help`` for each field's meaning and default."""

    preset: str = "qwen3.5-0.8b"
    prefill_tp: int = 1
    decode_tp: int = 1
    tokens: int = 2048
    requests: int = 16
    concurrency: int = 4
    fragmentation: float = 0.0
    mode: PlanMode = PlanMode.COALESCED
    device: Device = Device.CPU
    prefill_gpus: tuple[int, ...] = (0,)
    decode_gpus: tuple[int, ...] = (0,)
    kv_dtype: str | None = None  # key of KV_DTYPES; None: the model dtype
    seed: int = 0
    verify: bool = False
    warmup: int = 2
    rounds: int = 1
    sweep: Sweep = Sweep.NONE
    sweep_values: tuple[float, ...] = ()
    backend_threads: int | None = None  # EngineConfig.num_backend_threads of every rank (None: its default)
    kv_layout: str = KVLayout.INTERLEAVED.value  # attention page layout of both sides (vLLM 0.33's default)
    split_batch_size: int | None = None  # EngineConfig.split_batch_size of every rank (None: its default)
    post_thread: bool | None = None  # EngineConfig.post_thread of every decode rank (None: its default)
    # How block ids are drawn: "fragmentation" (verify.make_requests with --fragmentation) or "vllm-pool"
    # (vLLM 0.33's shared block pool after a churn of requests, bench/vllm_pool.py)
    allocation: str = "fragmentation"
    transport: str = "shm"  # bench/transport.py: shm (UCX's choice on one host) or tcp (UCX limited to TCP)
    # Decode steps: up to per_step requests start together in one Consumer.start_reads call (None: concurrency),
    # posted as EngineConfig.read_batching says (docs/lifecycle.md#batched-reads)
    per_step: int | None = None
    read_batching: str = "per_step"
    # "nixl": every variant reads over NIXL, as before issue 28. "mapped" (or "auto"): the run also times the
    # mapped path (Variant.MAPPED, and MAPPED_AUTO with --mode auto) beside the NIXL variants, every rank with
    # a shared secret (the mapped path needs one) and producer caches a consumer can map (docs/tuning.md#mapped-reads)
    read_transport: str = "nixl"

    ALLOCATIONS: ClassVar[tuple[str, ...]] = ("fragmentation", "vllm-pool")

    def validate(self) -> BenchSpec:
        """Return self, or raise ConfigError naming the first bad field."""
        load_preset(self.preset)  # UnknownPresetError names the shipped ones
        max_tokens = context_tokens(preset_config(self.preset))
        for name in ("prefill_tp", "decode_tp", "requests", "concurrency", "rounds"):
            if getattr(self, name) < 1:
                _bad(name, getattr(self, name), "must be >= 1")
        if self.backend_threads is not None and self.backend_threads < 0:
            _bad("backend_threads", self.backend_threads, "must be >= 0")
        if self.split_batch_size is not None and self.split_batch_size < 1:
            _bad("split_batch_size", self.split_batch_size, "must be >= 1")
        p, d = self.prefill_tp, self.decode_tp
        if p % d and d % p:
            _bad("decode_tp", d, f"and prefill TP {p}: one must divide the other")
        if self.tokens < 0:
            _bad("tokens", self.tokens, "must be >= 0")
        if self.seed < 0:
            _bad("seed", self.seed, "must be >= 0")
        most = max((self.tokens, *(self.sweep_values if self.sweep is Sweep.TOKENS else ())))
        if max_tokens is not None and most > max_tokens:
            _bad("tokens", most, f"exceeds the {max_tokens} tokens that {self.preset} allows (max_position_embeddings)")
        if not 0.0 <= self.fragmentation <= 1.0:
            _bad("fragmentation", self.fragmentation, "must be in [0, 1]")
        if self.warmup < 0:
            _bad("warmup", self.warmup, "must be >= 0")
        if self.kv_dtype is not None and self.kv_dtype not in KV_DTYPES:
            _bad("kv_dtype", self.kv_dtype, f"must be one of {sorted(KV_DTYPES)}")
        if self.kv_layout not in {m.value for m in KVLayout}:
            _bad("kv_layout", self.kv_layout, f"must be one of {[m.value for m in KVLayout]}")
        for name in ("prefill_gpus", "decode_gpus"):
            gpus = getattr(self, name)
            if not gpus or any(g < 0 for g in gpus):
                _bad(name, gpus, "must list one or more GPU indices >= 0")
        if self.sweep is Sweep.TOKENS and any(v < 0 or v != int(v) for v in self.sweep_values):
            _bad("sweep_values", self.sweep_values, "token counts must be non-negative integers")
        if self.sweep is Sweep.FRAGMENTATION and any(not 0.0 <= v <= 1.0 for v in self.sweep_values):
            _bad("sweep_values", self.sweep_values, "fragmentations must lie in [0, 1]")
        if self.allocation not in self.ALLOCATIONS:
            _bad("allocation", self.allocation, f"must be one of {list(self.ALLOCATIONS)}")
        if self.allocation == "vllm-pool":
            if self.fragmentation or self.sweep is Sweep.FRAGMENTATION:
                _bad("allocation", self.allocation, "draws its own block ids: drop --fragmentation and "
                     "--sweep fragmentation")
            if min(p.tokens for p in self.points) < 1:
                _bad("tokens", min(p.tokens for p in self.points), "must be >= 1 with --allocation vllm-pool")
        if self.transport not in ("shm", "tcp"):  # bench/transport.py TRANSPORTS
            _bad("transport", self.transport, "must be one of ['shm', 'tcp']")
        if self.transport == "tcp" and self.device is not Device.CPU:
            _bad("transport", self.transport, "is measured on CPU only (GPU memory over TCP needs cuda_copy too)")
        if self.per_step is not None and not 1 <= self.per_step <= self.concurrency:
            _bad("per_step", self.per_step, f"must lie in [1, concurrency {self.concurrency}]: a step starts at "
                 "most the requests that may be in flight")
        if self.read_batching not in READ_BATCHING:
            _bad("read_batching", self.read_batching, f"must be one of {list(READ_BATCHING)}")
        if self.read_transport not in READ_TRANSPORTS:
            _bad("read_transport", self.read_transport, f"must be one of {list(READ_TRANSPORTS)}")
        if self.sweep is Sweep.NONE and self.sweep_values:
            _bad("sweep_values", self.sweep_values, "need --sweep fragmentation or --sweep tokens")
        return self

    @property
    def step_size(self) -> int:
        """Requests a decode rank starts in one start_reads call at most (--per-step, default --concurrency)."""
        return self.concurrency if self.per_step is None else self.per_step

    @property
    def cache_options(self) -> CacheOptions:
        return CacheOptions(kv_dtype=KV_DTYPES[self.kv_dtype] if self.kv_dtype else None,
                            kv_layout=KVLayout(self.kv_layout))

    @property
    def points(self) -> tuple[Point, ...]:
        """The request shapes to run: one, or one per sweep value."""
        if self.sweep is Sweep.NONE:
            return (Point(self.tokens, self.fragmentation),)
        values = self.sweep_values or DEFAULT_SWEEP_VALUES[self.sweep.value]
        if self.sweep is Sweep.TOKENS:
            return tuple(Point(int(v), self.fragmentation) for v in values)
        return tuple(Point(self.tokens, float(v)) for v in values)

    @property
    def variants(self) -> tuple[Variant, ...]:
        """Timed phases per point: the chosen mode, coalesced beside pack and auto (the direct path they must
        beat in the same run), naive (unless it is the chosen one), the ceiling, the copy."""
        chosen = Variant(self.mode.value)
        if chosen is Variant.NAIVE:
            return (chosen, Variant.CEILING, Variant.COPY)
        direct = (Variant.COALESCED,) if chosen in (Variant.PACK, Variant.AUTO) else ()
        if self.mapped:  # the mapped path beside NIXL's; naive (vLLM's descriptors over NIXL) is left out
            both = chosen in (Variant.AUTO, Variant.PACK)
            mapped = (Variant.MAPPED, Variant.MAPPED_AUTO) if both else (Variant.MAPPED,)
            return (*mapped, chosen, *direct, Variant.CEILING, Variant.COPY)
        return (chosen, *direct, Variant.NAIVE, Variant.CEILING, Variant.COPY)

    @property
    def mapped(self) -> bool:
        """Whether the run times the mapped read path (and so sets a secret and shareable producer caches)."""
        return self.read_transport != "nixl"

    def round_order(self, round_index: int) -> tuple[Variant, ...]:
        """Variants of one round, rotated each round so no variant always runs first (or last)."""
        v = self.variants
        k = round_index % len(v)
        return v[k:] + v[:k]

    def gpu_of(self, is_prefill: bool, tp_rank: int) -> int:
        """GPU index of a rank process: the side's list, round-robin over ranks."""
        gpus = self.prefill_gpus if is_prefill else self.decode_gpus
        return gpus[tp_rank % len(gpus)]


def _bad(field: str, value: object, why: str) -> None:
    raise ConfigError(f"bench {field}={value!r} {why}", field=field, value=value)
