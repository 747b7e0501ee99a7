"""Count the descriptors vLLM 0.33.0's own NIXL pull worker posts per READ, and ours for the same request.

vLLM's side runs its real ``NixlPullConnectorWorker`` (registration, handshake, TP mapping, descriptor
ids) over caches from its own ``allocate_kv_cache``. Only the edges are replaced: the NIXL agent by a
recording fake that prepares nothing and moves nothing, the TP group by a fixed rank and size, the
attention backend by vLLM's CPU backend with FlashAttention's kernel sizes (any multiple of 16, as on
a GPU), and the platform's NUMA discovery by an empty one (a CPU worker would pin the whole process to
one core). Everything vLLM derives (block sizes, padded pages, groups, regions,
descriptor lists) comes from vLLM's code. The SSM state dtype is named per engine (``build_engine``),
never left to vLLM's host-dependent ``auto``, and our side plans with the same one.

Our side plans the same request with ``hybrid_transfer``'s planner in ``naive`` mode.

Needs the vLLM environment (``scripts/vllm_env.sh``) with ``VLLM_TARGET_DEVICE=cpu`` and
``VLLM_SSM_CONV_STATE_LAYOUT=DS``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import numpy as np
import torch

TINY = "tiny"
QWEN35_08B = "qwen3.5-0.8b"

# Sizes vLLM's model config wants but the cache never sees; small so nothing large is built.
_UNUSED_SIZES = {
    "hidden_size": 64, "intermediate_size": 64, "vocab_size": 256, "num_attention_heads": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "max_position_embeddings": 8192,
}
_CACHE_KEYS = (
    "num_hidden_layers", "full_attention_interval", "num_key_value_heads", "head_dim",
    "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
    "linear_conv_kernel_dim", "mamba_ssm_dtype",
)


def _tiny_config() -> dict:
    """The tests' tiny model (tests/tiny_model.py), the one every other test moves."""
    import sys

    tests_dir = str(Path(__file__).resolve().parents[1])
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    from tiny_model import TINY_CONFIG

    return TINY_CONFIG


def cache_fields(name: str) -> dict:
    """The cache-shaping fields of a model: the tests' tiny model or a packaged preset."""
    if name == TINY:
        return {k: _tiny_config()[k] for k in _CACHE_KEYS}
    from hybrid_transfer.layout import presets

    text = json.loads((Path(presets.__file__).parent / f"{name}.json").read_text())["text_config"]
    kinds = text["layer_types"]
    interval = kinds.index("full_attention") + 1
    expected = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(kinds))]
    if kinds != expected:
        raise ValueError(f"{name}: layer_types are not every {interval}th full attention")
    return {**{k: text[k] for k in _CACHE_KEYS if k in text}, "full_attention_interval": interval}


@functools.cache
def model_dir(name: str) -> str:
    """A local Qwen3-Next config directory with the model's cache shapes (no weights, no hub)."""
    cfg = {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16",
        **_UNUSED_SIZES, **cache_fields(name),
    }
    path = tempfile.mkdtemp(prefix=f"naive-{name}-")
    Path(path, "config.json").write_text(json.dumps(cfg))
    return path


@functools.cache
def _model_config(name: str):
    from vllm.config import ModelConfig

    return ModelConfig(model=model_dir(name), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=8192)


def kernel_backend(multiple_of: int | None = 16, fixed: int | None = None):
    """vLLM's CPU attention backend reporting FlashAttention-like kernel sizes (or one fixed size)."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = [fixed] if fixed is not None else [MultipleOf(multiple_of)]

    class KernelSizedBackend(CPUAttentionBackend):
        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return list(sizes)

    return KernelSizedBackend


@dataclass
class Engine:
    """One side's vLLM config and KV cache config, as vLLM's own planning code produced them."""

    vllm_config: object
    kv_cache_config: object
    tp_size: int
    backend: type
    ssm_dtype: str  # the SSM state dtype the engine was configured with (vLLM's mamba_ssm_cache_dtype)
    block_size: int = field(init=False)

    def __post_init__(self):
        self.block_size = self.vllm_config.cache_config.block_size


def build_engine(name: str, tp_size: int, num_blocks: int, block_size: int | None = None,
                 backend: type | None = None, ssm_dtype: str | None = None) -> Engine:
    """VllmConfig + KVCacheConfig for one engine at ``tp_size``, built by vLLM's config and planning code.

    ``block_size`` forces the logical block size (vLLM only raises it to fit the state page).
    ``ssm_dtype``: the SSM state dtype; None takes the model's ``mamba_ssm_dtype``, as vLLM does for a
    Qwen3.5 architecture (for the Qwen3-Next config written here vLLM would use ``auto``, which its CPU
    platform resolves by the host's ISA).
    """
    from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig

    from hybrid_transfer.integrations.vllm_peer.model import hybrid_kv_cache_config

    backend = backend or kernel_backend()
    ssm_dtype = ssm_dtype or cache_fields(name)["mamba_ssm_dtype"]
    model_config = copy.deepcopy(_model_config(name))
    # No prefix caching: a request then owns one state block per GDN group, as hybrid_transfer assumes.
    cache = CacheConfig(block_size=block_size or 16, enable_prefix_caching=False, mamba_ssm_cache_dtype=ssm_dtype)
    cache.num_gpu_blocks_override = num_blocks
    vc = VllmConfig(
        model_config=model_config, cache_config=cache,
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
        kv_transfer_config=KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both"),
    )
    vc.cache_config.kv_cache_layout = "LBHNC"  # what vLLM resolves for NIXL's required layout
    kvc = hybrid_kv_cache_config(vc, backend, num_blocks)
    return Engine(vc, kvc, tp_size, backend, ssm_dtype)


def live_ssm_dtypes(kv_cache_config) -> set[str]:
    """The SSM state dtypes of vLLM's Mamba specs, as dtype names ("float32")."""
    return {str(g.kv_cache_spec.dtypes[1]).removeprefix("torch.") for g in kv_cache_config.kv_cache_groups
            if type(g.kv_cache_spec).__name__ == "MambaSpec"}


class RecordingNixl:
    """Stands in for vLLM's NIXL agent: remembers the descriptor lists prepared and the READs posted."""

    def __init__(self, name, config=None):
        self.name = name
        self.dlists: dict[int, np.ndarray] = {}  # handle -> (addr, len) per descriptor
        self.reads: list[tuple[int, np.ndarray, int, np.ndarray]] = []

    # memory and agents
    def get_reg_descs(self, ranges, mem_type):
        return list(ranges)

    def register_memory(self, descs, backends=None):
        return None

    def deregister_memory(self, descs, backends=None):
        return None

    def get_agent_metadata(self):
        return self.name.encode()

    def add_remote_agent(self, metadata):
        return metadata.decode()

    def remove_remote_agent(self, name):
        return None

    def create_backend(self, *args, **kwargs):
        return None

    # descriptor lists and transfers
    def prep_xfer_dlist(self, agent, descs, mem_type=None, **kwargs):
        rows = np.asarray(descs, dtype=np.uint64).reshape(-1, 5)
        expanded = [
            (int(addr) + k * int(stride), int(length))
            for addr, length, _dev, stride, count in rows
            for k in range(int(count))
        ]
        handle = len(self.dlists) + 1
        self.dlists[handle] = np.asarray(expanded, dtype=np.int64).reshape(-1, 2)
        return handle

    def make_prepped_xfer(self, op, local_handle, local_ids, remote_handle, remote_ids, notif_msg=b""):
        if op != "READ":
            raise AssertionError(f"pull worker posted {op}")
        self.reads.append((local_handle, np.asarray(local_ids), remote_handle, np.asarray(remote_ids)))
        return len(self.reads)

    def transfer(self, handle, *args, **kwargs):
        return "PROC"

    def check_xfer_state(self, handle):
        return "DONE"

    def send_notif(self, agent, notif_msg=b""):
        return None

    def get_new_notifs(self):
        return {}

    def release_xfer_handle(self, handle):
        return None

    def release_dlist_handle(self, handle):
        return None

    def get_xfer_telemetry(self, handle):
        raise RuntimeError("no telemetry in the recording fake")


def make_worker(engine: Engine, engine_id: str, tp_rank: int):
    """vLLM's real pull worker for one TP rank of ``engine``, with its caches registered."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_worker import NixlPullConnectorWorker
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_transfer.integrations.vllm_peer.engine import NoCorePinningPlatform

    if os.environ.get("VLLM_SSM_CONV_STATE_LAYOUT") != "DS":
        raise RuntimeError("set VLLM_SSM_CONV_STATE_LAYOUT=DS: vLLM's worker refuses hybrids without it")
    kvc = engine.kv_cache_config
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        enter(mock.patch.object(base_worker, "NixlWrapper", RecordingNixl))
        enter(mock.patch.object(base_worker, "get_tensor_model_parallel_rank", lambda: tp_rank))
        enter(mock.patch.object(base_worker, "get_tensor_model_parallel_world_size", lambda: engine.tp_size))
        enter(mock.patch.object(base_worker, "get_current_attn_backends", lambda *a, **k: [engine.backend]))
        enter(mock.patch.object(base_worker, "current_platform", NoCorePinningPlatform(base_worker.current_platform)))
        worker = NixlPullConnectorWorker(engine.vllm_config, engine_id, kvc)
        kernel_sizes = [
            g.kv_cache_spec.block_size // worker._physical_blocks_per_logical_kv_block
            if type(g.kv_cache_spec).__name__ != "MambaSpec" else g.kv_cache_spec.block_size
            for g in kvc.kv_cache_groups
        ]
        caches = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout.LBHNC, kernel_sizes)
        worker.register_kv_caches(caches)
    worker._test_caches = caches  # keep the memory alive as long as the worker
    return worker


def agent_metadata(worker):
    """The NixlAgentMetadata a worker publishes in its handshake, decoded as a peer would."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlAgentMetadata

    return msgspec.msgpack.decode(worker.xfer_handshake_metadata.agent_metadata_bytes, type=NixlAgentMetadata)


def group_is_attention(kv_cache_config) -> list[bool]:
    return [type(g.kv_cache_spec).__name__ != "MambaSpec" for g in kv_cache_config.kv_cache_groups]


def request_block_ids(kv_cache_config, block_size: int, num_tokens: int, first_id: int = 1) -> list[list[int]]:
    """Distinct logical ids per vLLM group: ceil(n / B) per attention group, one per GDN group."""
    out, next_id = [], first_id
    for is_attn in group_is_attention(kv_cache_config):
        n = -(-num_tokens // block_size) if is_attn else 1
        out.append(list(range(next_id, next_id + n)))
        next_id += n
    return out


@dataclass
class VllmRead:
    """One READ vLLM's worker posted: its descriptor count and the bytes it moves."""

    source_rank: int
    descriptors: int
    nbytes: int


class VllmPull:
    """vLLM's decode worker ``decode_rank`` handshaken with every rank of a prefill engine, ready to read."""

    def __init__(self, prefill: Engine, decode: Engine, decode_rank: int = 0):
        self.prefill, self.decode = prefill, decode
        self.producers = [make_worker(prefill, "prefill", r) for r in range(prefill.tp_size)]
        self.consumer = make_worker(decode, "decode", decode_rank)
        for r, p in enumerate(self.producers):
            name = self.consumer.add_remote_agent(agent_metadata(p), remote_tp_rank=r,
                                                  remote_tp_size=prefill.tp_size)
            # What the worker's background handshake records once it has added the agents.
            self.consumer._remote_agents["prefill"][(0, r)] = name
        self.consumer._engine_clock_offset["prefill"] = 0.0
        self._requests = 0

    @property
    def kernel_sizes(self) -> tuple[int, int]:
        """(prefill, decode) attention kernel block sizes: a worker's block_size after its kernel check."""
        return self.producers[0].block_size, self.consumer.block_size

    def read(self, num_tokens: int) -> list[VllmRead]:
        """The READs the worker posts for one request of ``num_tokens`` tokens, one per source rank."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

        consumer, nixl = self.consumer, self.consumer.nixl_wrapper
        self._requests += 1
        req_id = f"req-{self._requests}"
        local = request_block_ids(self.decode.kv_cache_config, self.decode.block_size, num_tokens)
        remote = request_block_ids(self.prefill.kv_cache_config, self.prefill.block_size, num_tokens)
        meta = ReqMeta(
            local_block_ids=local,
            local_physical_block_ids=consumer._logical_to_kernel_block_ids(
                local, consumer._physical_blocks_per_logical_kv_block),
            tp_size=self.prefill.tp_size,
            remote=RemoteMeta(block_ids=remote, host="localhost", port=0, engine_id="prefill",
                              request_id=req_id, num_tokens=num_tokens),
            awaiting_kvs=True,
        )
        before = len(nixl.reads)
        consumer._read_blocks_for_req(req_id, meta)
        failed = consumer._failed_recv_reqs.qsize() or req_id in consumer._recv_failures
        if failed:
            raise RuntimeError(f"vLLM's worker failed the read of {req_id} instead of posting it")
        rank_of_handle = {h: rank for rank, h in consumer.dst_xfer_side_handles["prefill"].items()}
        reads = []
        for local_handle, local_ids, remote_handle, remote_ids in nixl.reads[before:]:
            if len(local_ids) != len(remote_ids):
                raise AssertionError("vLLM posted a READ whose local and remote lists differ in length")
            lengths = nixl.dlists[local_handle][local_ids, 1]
            if not np.array_equal(lengths, nixl.dlists[remote_handle][remote_ids, 1]):
                raise AssertionError("vLLM paired descriptors of different lengths")
            reads.append(VllmRead(rank_of_handle[remote_handle], len(local_ids), int(lengths.sum())))
        return reads




@dataclass
class OurRead:
    """One source's READ in our naive plan: descriptor count and planned bytes."""

    source_rank: int
    descriptors: int
    nbytes: int


def our_model(name: str):
    from hybrid_transfer.layout import load_preset, model_from_config

    if name == TINY:
        return model_from_config(_tiny_config(), name=TINY)
    return load_preset(name)


def our_naive_reads(name: str, prefill: Engine, decode: Engine, num_tokens: int, decode_rank: int = 0,
                    kernel_sizes: tuple[int | None, int | None] = (None, None)) -> list[OurRead]:
    """Our planner's naive plan of one request between the two engines, with their block sizes.

    ``kernel_sizes``: (prefill, decode) attention kernel block sizes; None keeps the logical block.
    ``VllmPull.kernel_sizes`` gives the ones vLLM's workers settled on. Each side's SSM state dtype is
    its engine's.
    """
    from hybrid_transfer.cli.plan_cmd import plan_all
    from hybrid_transfer.layout import CacheOptions
    from hybrid_transfer.plan.types import PlanMode

    prefill_opts = CacheOptions(block_size=prefill.block_size, kernel_block_size=kernel_sizes[0],
                                ssm_dtype=prefill.ssm_dtype)
    decode_opts = CacheOptions(block_size=decode.block_size, kernel_block_size=kernel_sizes[1],
                               ssm_dtype=decode.ssm_dtype)
    [plan] = plan_all(our_model(name), prefill.tp_size, decode.tp_size, prefill_opts, decode_opts, num_tokens,
                      PlanMode.NAIVE, 0.0, 0, decode_rank)
    return [OurRead(s.source_rank, s.num_descriptors, s.total_bytes) for s in plan.sources]
