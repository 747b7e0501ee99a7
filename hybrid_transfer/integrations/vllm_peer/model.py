"""One engine's vLLM config and KV cache config for a preset, built by vLLM's own config and planning code.

The model is a local ``config.json`` with the preset's cache-shaping fields (no weights, no hub):
vLLM resolves the block size and the padded state page (``Platform._align_hybrid_block_size``),
groups the layers and places the tensors (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``).
Both connectors of a side-by-side run get configs built here from the same arguments, so their
caches (``allocate_kv_cache`` of the same KVCacheConfig) are laid out identically.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from hybrid_transfer.errors import ConfigError

VLLM_NIXL = "vllm-nixl"  # vLLM 0.33's NixlConnector (pull), its defaults (NIXL's progress thread on)
HYBRID = "hybrid"  # ours, our engine's defaults (no NIXL progress thread: poll() progresses UCX)
HYBRID_PROGRESS = "hybrid-progress"  # ours with NIXL's progress thread, as vLLM's agent runs
HYBRID_POST = "hybrid-post"  # ours with the posting thread (EngineConfig.post_thread): READs posted off the worker thread
CONNECTORS = (VLLM_NIXL, HYBRID, HYBRID_PROGRESS, HYBRID_POST)

# Sizes vLLM's model config wants but the cache never sees; small, since no layer is built.
_UNUSED_SIZES = {
    "hidden_size": 64, "intermediate_size": 64, "vocab_size": 256, "num_attention_heads": 8,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
}
_CACHE_KEYS = (
    "num_hidden_layers", "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "mamba_ssm_dtype",
)
KERNEL_MULTIPLE = 16  # FlashAttention's kernel block rule (any multiple of 16), as on a GPU
DEVICES = ("cpu", "cuda")  # where the caches may live (EngineShape.device)
SSM_DTYPES = ("float32", "bfloat16", "float16")  # vLLM's --mamba-ssm-cache-dtype but "auto" (a host's choice on CPU)


def preset_cache_fields(preset: str) -> dict:
    """The cache-shaping fields of a packaged preset, as a Qwen3-Next config (every k-th layer full attention)."""
    from hybrid_transfer.layout import preset_names, presets

    if preset not in preset_names():
        raise ConfigError(f"unknown preset {preset!r}; known: {', '.join(preset_names())}", field="preset",
                          value=preset)
    text = json.loads((Path(presets.__file__).parent / f"{preset}.json").read_text())["text_config"]
    kinds = text["layer_types"]
    interval = kinds.index("full_attention") + 1
    if kinds != ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(len(kinds))]:
        raise ConfigError(f"{preset}: layer_types are not every {interval}th layer full attention", field="preset",
                          value=preset)
    return {**{k: text[k] for k in _CACHE_KEYS if k in text}, "full_attention_interval": interval}


@functools.cache
def model_dir(preset: str, max_model_len: int) -> str:
    """A local config.json directory with the preset's cache shapes, at one path for every process.

    vLLM's NIXL handshake compares a hash of the model path: prefill and decode must name the same one.
    """
    cfg = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16",
           "max_position_embeddings": max_model_len, **_UNUSED_SIZES, **preset_cache_fields(preset)}
    path = Path(tempfile.gettempdir()) / "hybrid-transfer-vllm-peer" / f"{preset}-{max_model_len}"
    path.mkdir(parents=True, exist_ok=True)
    text = json.dumps(cfg, sort_keys=True)
    target = path / "config.json"
    if not target.exists() or target.read_text() != text:
        tmp = path / f".config.{os.getpid()}.json"
        tmp.write_text(text)
        os.replace(tmp, target)  # atomic: a concurrent reader sees the old or the new file, never half
    return str(path)


@functools.cache
def attention_backend():
    """An attention backend that reports only FlashAttention's kernel block rule and vLLM's LBHNC layout.

    The live layers that would report a backend are never built here, and no kernel runs: vLLM's block-size
    alignment and its NIXL worker read the kernel block sizes, the layout and the name (the handshake's
    compatibility hash). The same class serves CPU and CUDA caches (FlashAttention's own backend needs its
    compiled kernels, which a host without vLLM's build lacks). One class per process (cached).
    """
    from vllm.v1.attention.backend import AttentionBackend, MultipleOf
    from vllm.v1.kv_cache_interface import KVCacheLayout

    class KernelSizedBackend(AttentionBackend):
        @staticmethod
        def get_name() -> str:
            return "HT_KERNEL_SIZED"

        @staticmethod
        def get_impl_cls():
            raise NotImplementedError("no attention kernel: integrations/vllm_peer builds no layer")

        @staticmethod
        def get_builder_cls():
            raise NotImplementedError("no attention kernel: integrations/vllm_peer builds no layer")

        @staticmethod
        def get_supported_kernel_block_sizes(kv_cache_spec=None):
            return [MultipleOf(KERNEL_MULTIPLE)]

        @classmethod
        def supported_kv_cache_layouts(cls):
            return (KVCacheLayout.LBHNC,)

    return KernelSizedBackend


@dataclass(frozen=True)
class EngineShape:
    """What both connectors' engines share: model, request size, pool size, batch limits, UCX threads, device."""

    preset: str
    tokens: int  # tokens whose KV moves per request (the prompt is tokens + 1: N-1 move)
    num_blocks: int
    max_num_seqs: int
    num_threads: int = 0  # UCX thread-pool threads of every NIXL agent (vLLM's num_threads, our num_backend_threads)
    device: str = "cpu"  # where both engines' caches live: "cpu", or "cuda" (GPU 0 for both processes)
    ssm_dtype: str | None = None  # vLLM's mamba_ssm_cache_dtype; None: the preset's mamba_ssm_dtype

    @property
    def max_model_len(self) -> int:
        return max(2048, self.tokens + 64)

    @property
    def mamba_ssm_cache_dtype(self) -> str:
        """The SSM state dtype both engines are configured with, never vLLM's ``auto``.

        The config written here names Qwen3-Next, for which vLLM does not read ``mamba_ssm_dtype``, and vLLM's
        CPU platform resolves ``auto`` by the host (float32 only with AVX-512-BF16, else the model's bfloat16),
        which changes the state page, the block size and every descriptor length. A Qwen3.5 architecture would
        take the preset's ``mamba_ssm_dtype``; so does the default here (bfloat16 where it names none, as
        layout/model.py reads a config without it).
        """
        return self.ssm_dtype or preset_cache_fields(self.preset).get("mamba_ssm_dtype", "bfloat16")


def connector_transfer_config(connector: str, kv_role: str, shape: EngineShape):
    """The KVTransferConfig of ``connector`` (vLLM's NixlConnector or ours) with the shape's UCX threads."""
    from vllm.config import KVTransferConfig

    engine_id = f"{connector}-{kv_role}-{uuid.uuid4().hex[:8]}"
    if connector == VLLM_NIXL:
        return KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, engine_id=engine_id,
                                kv_buffer_device=shape.device,  # the caches' own memory, no host staging
                                kv_connector_extra_config={"num_threads": shape.num_threads})
    if connector in (HYBRID, HYBRID_PROGRESS, HYBRID_POST):
        extra = {"num_backend_threads": shape.num_threads}
        if connector == HYBRID_PROGRESS:
            extra["progress"] = "on"
        if connector == HYBRID_POST:
            extra["post_thread"] = True
        return KVTransferConfig(kv_connector="HybridNixlConnector",
                                kv_connector_module_path="hybrid_transfer.integrations.vllm", kv_role=kv_role,
                                engine_id=engine_id, kv_connector_extra_config=extra)
    raise ConfigError(f"unknown connector {connector!r}; known: {', '.join(CONNECTORS)}", field="connector",
                      value=connector)


def build_configs(connector: str, kv_role: str, shape: EngineShape):
    """(VllmConfig, KVCacheConfig) of one TP1 engine: vLLM's block size, groups and tensor placement."""
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig, VllmConfig

    backend = attention_backend()
    model = ModelConfig(model=model_dir(shape.preset, shape.max_model_len), dtype="bfloat16",
                        skip_tokenizer_init=True, max_model_len=shape.max_model_len, enforce_eager=True)
    cache = CacheConfig(block_size=16, enable_prefix_caching=False, mamba_ssm_cache_dtype=shape.mamba_ssm_cache_dtype)
    cache.num_gpu_blocks_override = shape.num_blocks
    vc = VllmConfig(
        model_config=model, cache_config=cache,
        scheduler_config=SchedulerConfig(max_num_seqs=shape.max_num_seqs,
                                         max_num_batched_tokens=max(shape.max_model_len,
                                                                    shape.max_num_seqs * (shape.tokens + 1)),
                                         max_model_len=shape.max_model_len, is_encoder_decoder=False),
        parallel_config=ParallelConfig(tensor_parallel_size=1), device_config=DeviceConfig(shape.device),
        kv_transfer_config=connector_transfer_config(connector, kv_role, shape),
    )
    vc.cache_config.kv_cache_layout = "LBHNC"  # what vLLM resolves for NIXL's required layout (both connectors')
    kvc = hybrid_kv_cache_config(vc, backend, shape.num_blocks)
    kvc.kv_cache_layout = "LBHNC"
    return vc, kvc


def hybrid_kv_cache_config(vc, backend, num_blocks: int):
    """vLLM's KVCacheConfig of ``vc``'s hybrid model with ``num_blocks`` blocks, from vLLM's own planning code.

    First aligns ``vc``'s attention block size and padded state page by vLLM's rule for a hybrid (which reads
    the backends from live layers; a config-only engine has none, so ``backend`` stands in); then one spec
    per full-attention and GDN layer at ``vc``'s TP size, grouped and placed as vLLM's planner does.
    """
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.platforms.interface import Platform
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    model = vc.model_config
    with mock.patch.object(Platform, "_find_non_ssm_backends", classmethod(lambda cls, cfg: [backend])):
        Platform._align_hybrid_block_size(vc, backend)
    model_cls, _ = ModelRegistry.resolve_model_cls(model.architecture, model_config=model)
    specs = {}
    for i, kind in enumerate(model.hf_text_config.layer_types):
        if kind == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = FullAttentionSpec(
                block_size=vc.cache_config.block_size, num_kv_heads=model.get_num_kv_heads(vc.parallel_config),
                head_size=model.get_head_size(), dtype=model.dtype)
        else:
            specs[f"model.layers.{i}.linear_attn"] = MambaSpec(
                block_size=vc.cache_config.mamba_block_size or model.max_model_len,
                shapes=tuple(model_cls.get_mamba_state_shape_from_config(vc)),
                dtypes=tuple(model_cls.get_mamba_state_dtype_from_config(vc)),
                page_size_padded=vc.cache_config.mamba_page_size_padded,
                mamba_type=MambaAttentionBackendEnum.GDN_ATTN, mamba_cache_mode="none")
    groups = get_kv_cache_groups(vc, specs)
    page = max(g.kv_cache_spec.page_size_bytes for g in groups)
    return get_kv_cache_config_from_groups(vc, groups, available_memory=page * len(specs) * num_blocks)


def blocks_per_request(kvc, tokens: int) -> int:
    """Blocks one request holds on either side: ceil((tokens + 1) / B) per attention group, one per state group."""
    out = 0
    for g in kvc.kv_cache_groups:
        spec = g.kv_cache_spec
        out += -(-(tokens + 1) // spec.block_size) if type(spec).__name__ != "MambaSpec" else 1
    return out
