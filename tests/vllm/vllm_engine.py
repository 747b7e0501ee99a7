"""Real vLLM 0.33 pieces for the connector tests: configs, cache configs, schedulers, requests.

Everything that decides a size (page sizes, the padded state page, block sizes, group order,
the cache tensors) is computed by vLLM's own code from a tiny local Qwen3-Next config; these
helpers only choose the knobs (block size, TP size, number of blocks, SSM state dtype) and
assemble the parts the way vLLM's engine core does. No knob is left to the host: vLLM's CPU
platform would resolve an ``auto`` SSM dtype by the host's ISA (test_host_decisions.py).
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import torch
from attention_stand_in import declare_attention_backend
from tiny_model import TINY_CONFIG
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.model_executor.layers.mamba.abstract import MambaAttentionBackendEnum
from vllm.model_executor.models.qwen3_next import Qwen3NextForCausalLM
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.utils import _apply_dp_identity_suffix
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

MAX_MODEL_LEN = 2048
# The tiny model's mamba_ssm_dtype. vLLM reads that field only for Qwen3.5 architectures; for this
# Qwen3-Next config an unset dtype would be "auto", which the CPU platform resolves by the host.
SSM_DTYPE = TINY_CONFIG["mamba_ssm_dtype"]
CONNECTOR = {"kv_connector": "HybridNixlConnector", "kv_connector_module_path": "hybrid_transfer.integrations.vllm"}


def write_tiny_model(directory: Path, *, layer_types: list[str] | None = None) -> Path:
    """A local Qwen3-Next config.json with the tests' tiny cache dimensions (no weights: none are loaded).

    ``layer_types`` overrides the hybrid pattern (e.g. all "full_attention" for an attention-only model).
    """
    cfg = {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"],
        "num_hidden_layers": TINY_CONFIG["num_hidden_layers"],
        "full_attention_interval": TINY_CONFIG["full_attention_interval"],
        "num_attention_heads": 4, "num_key_value_heads": TINY_CONFIG["num_key_value_heads"],
        "head_dim": TINY_CONFIG["head_dim"],
        **{k: TINY_CONFIG[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                       "linear_value_head_dim", "linear_conv_kernel_dim")},
        "hidden_size": 32, "intermediate_size": 64, "vocab_size": 256, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
    }
    if layer_types is not None:
        cfg["layer_types"] = layer_types
        del cfg["full_attention_interval"]
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def make_vllm_config(model_dir: Path, *, tp_size: int, block_size: int, kv_role: str, extra: dict | None = None,
                     max_num_batched_tokens: int = 4096, engine_id: str | None = None,
                     scheduler_reserve_full_isl: bool = True, kv_load_failure_policy: str = "recompute",
                     dp_size: int = 1, dp_rank: int = 0, ssm_dtype: str = SSM_DTYPE,
                     prefix_caching: bool = False) -> VllmConfig:
    """One engine's config: the tiny model at ``tp_size`` with an explicitly configured block size and SSM
    state dtype (``ssm_dtype``, what ``--mamba-ssm-cache-dtype`` sets).

    ``dp_size`` > 1: engine core ``dp_rank`` of a data-parallel endpoint, given its identity as
    vLLM's engine-core launcher does (``dp_engine_identity``).

    ``prefix_caching``: vLLM's default, which gives the GDN state ``mamba_cache_mode='align'`` (one state
    block per block of tokens, of the attention block size).
    """
    model = ModelConfig(model=str(model_dir), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN,
                        enforce_eager=True)
    kvt = KVTransferConfig(**CONNECTOR, kv_role=kv_role, engine_id=engine_id or f"e-{uuid.uuid4().hex[:8]}",
                           kv_connector_extra_config=dict(extra or {}), kv_load_failure_policy=kv_load_failure_policy)
    cfg = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching,
                                 mamba_cache_mode="align" if prefix_caching else "none", mamba_ssm_cache_dtype=ssm_dtype),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                                         max_model_len=MAX_MODEL_LEN, is_encoder_decoder=False,
                                         scheduler_reserve_full_isl=scheduler_reserve_full_isl),
        parallel_config=ParallelConfig(tensor_parallel_size=tp_size, data_parallel_size=dp_size,
                                       data_parallel_rank=dp_rank),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kvt,
    )
    cfg.cache_config.kv_cache_layout = "LBHNC"
    declare_attention_backend(cfg)  # no model here: the kernels' page interior is declared, token-major
    if dp_size > 1:
        dp_engine_identity(cfg, dp_rank)
    return cfg


def dp_engine_identity(cfg: VllmConfig, dp_rank: int) -> None:
    """What vLLM 0.33 does to a DP engine core's config before building it (``EngineCoreProc.run_engine_core``
    and the Ray launcher): vLLM's own ``_dp{rank}`` suffix on the engine and instance ids, ``data_parallel_index``
    = the DP rank, then the independent-engine path (``reconfigure_for_independent_dp_rank``), which resets
    ``data_parallel_rank`` to 0: only ``data_parallel_index`` still tells the engines apart."""
    _apply_dp_identity_suffix(cfg, dp_rank)
    cfg.parallel_config.data_parallel_index = dp_rank
    cfg.parallel_config.reconfigure_for_independent_dp_rank()


def layer_specs(cfg: VllmConfig) -> dict:
    """Per-layer specs as the model's layers would report them, with vLLM's own shapes, dtypes and page sizes."""
    hf = cfg.model_config.hf_text_config
    tp = cfg.parallel_config.tensor_parallel_size
    block_size = cfg.cache_config.block_size
    attention = FullAttentionSpec(block_size=block_size, num_kv_heads=max(1, hf.num_key_value_heads // tp),
                                  head_size=hf.head_dim, dtype=cfg.model_config.dtype)
    # vLLM pads the state page to the attention page (platforms/interface.py does the same sum).
    align = cfg.cache_config.mamba_cache_mode == "align"  # a state block per block of tokens
    mamba = None if "linear_attention" not in hf.layer_types else MambaSpec(
        block_size=block_size if align else MAX_MODEL_LEN, shapes=Qwen3NextForCausalLM.get_mamba_state_shape_from_config(cfg),
        dtypes=Qwen3NextForCausalLM.get_mamba_state_dtype_from_config(cfg),
        page_size_padded=attention.page_size_bytes, mamba_cache_mode=cfg.cache_config.mamba_cache_mode,
        mamba_type=MambaAttentionBackendEnum.GDN_ATTN)
    specs = {}
    for i in range(hf.num_hidden_layers):
        if hf.layer_types[i] == "full_attention":
            specs[f"model.layers.{i}.self_attn.attn"] = attention
        else:
            specs[f"model.layers.{i}.linear_attn"] = mamba
    return specs


def make_kv_cache_config(cfg: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """vLLM's grouping and tensor placement for ``num_blocks`` blocks."""
    specs = layer_specs(cfg)
    groups = get_kv_cache_groups(cfg, specs)
    page = next(iter(specs.values())).page_size_bytes
    num_slots = len(groups[0].layer_names)
    cfg.cache_config.num_gpu_blocks_override = num_blocks
    kvc = get_kv_cache_config_from_groups(cfg, groups, available_memory=num_blocks * page * num_slots)
    kvc.kv_cache_layout = "LBHNC"
    return kvc


def make_scheduler(cfg: VllmConfig, kvc: KVCacheConfig) -> Scheduler:
    """vLLM's v1 Scheduler (AsyncScheduler under async scheduling), built as EngineCore builds it (its class from
    ``get_scheduler_cls``, block sizes resolved by vLLM)."""
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kvc, cfg)
    return cfg.scheduler_config.get_scheduler_cls()(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(cfg), block_size=scheduler_block_size,
                     hash_block_size=hash_block_size)


def make_request(request_id: str, num_tokens: int, *, max_tokens: int = 2, params: dict | None = None,
                 block_hasher=None) -> Request:
    """A request of ``num_tokens`` prompt tokens carrying ``params`` as its kv_transfer_params. Every prompt is a
    prefix of one token sequence, so a longer prompt extends a shorter one (prefix caching hits it with
    ``block_hasher``, ``request_block_hasher``)."""
    extra = {"kv_transfer_params": params} if params is not None else None
    sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=extra)
    tokens = [(7 * i + 3) % 200 + 1 for i in range(num_tokens)]
    return Request(request_id, tokens, sampling, None, block_hasher=block_hasher)


def request_block_hasher(cfg: VllmConfig, kvc: KVCacheConfig):
    """The block hasher EngineCore gives every request when prefix caching is on."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    hash_fn = get_hash_fn_by_name(cfg.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    return get_request_block_hasher(resolve_kv_cache_block_sizes(kvc, cfg)[1], hash_fn)


def kernel_block_sizes(kvc: KVCacheConfig) -> list[int]:
    """Kernel block = logical block, as FlashAttention-style backends give (ratio 1)."""
    return [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]


def cpu() -> torch.device:
    return torch.device("cpu")
