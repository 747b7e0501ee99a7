"""Our view of a live vLLM cache: the rank geometry from vLLM's specs and the shared slots carved
out of vLLM's one backing allocation, without copying.

vLLM's numbers win where an engine may differ from the model's config (dtypes, block sizes,
kernel block size); everything else is checked against our registry, and any disagreement
is refused by name before a NIXL agent exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.cache_slots import slots_from_layer_views
from hybrid_transfer.errors import CacheShapeError, UnsupportedError
from hybrid_transfer.integrations.vllm.groups import GroupMap, layer_index
from hybrid_transfer.layout.geometry import CacheOptions, ConvLayout, KVLayout, RankGeometry
from hybrid_transfer.layout.model import DType, LayerKind, ModelSpec, model_from_config

REQUIRED_LAYOUT = "LBHNC"  # vLLM's name for [block][head][token][K|V] pages (alias HND)


@dataclass
class EngineCache:
    """One rank's cache as vLLM allocated it, wrapped for the engine."""

    cache: HybridCache
    group_map: GroupMap
    attention_views: dict[int, torch.Tensor]  # model layer -> vLLM's [kernel blocks, heads, tokens, K|V] view


def model_of(vllm_config) -> ModelSpec:
    """Our model spec from vLLM's (text) config; the model dtype is the engine's."""
    cfg = dict(vllm_config.model_config.hf_text_config.to_dict())
    cfg["dtype"] = str(vllm_config.model_config.dtype).removeprefix("torch.")
    return model_from_config(cfg, name=str(vllm_config.model_config.model).rstrip("/").rsplit("/", 1)[-1])


def _dtype(t: torch.dtype) -> DType:
    return DType.parse(str(t))


def _specs(kv_cache_config: KVCacheConfig) -> tuple[FullAttentionSpec, MambaSpec | None]:
    attention = mamba = None
    for gid in kv_cache_config.transfer_group_ids:
        spec = kv_cache_config.kv_cache_groups[gid].kv_cache_spec
        if isinstance(spec, FullAttentionSpec):
            attention = attention or spec
        elif isinstance(spec, MambaSpec):
            mamba = mamba or spec
        else:
            raise UnsupportedError(f"cache group {gid} has spec {type(spec).__name__}: only full attention and "
                                   "GDN state groups are supported (no sliding window, MLA or others)")
    if attention is None:
        raise UnsupportedError("the engine has no full-attention cache group")
    if mamba is not None and (mamba.mamba_cache_mode != "none" or mamba.num_speculative_blocks):
        raise UnsupportedError(f"GDN state with mamba_cache_mode={mamba.mamba_cache_mode!r} and "
                               f"{mamba.num_speculative_blocks} speculative blocks: only one state block per "
                               "request (mamba_cache_mode 'none', no speculative decoding) is supported")
    return attention, mamba


def wrap_engine_cache(vllm_config, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor],
                      tp_rank: int) -> EngineCache:
    """Build the geometry from vLLM's live specs and wrap its allocation as our shared slots.

    Raises:
        UnsupportedError: a layout, conv layout, group or spec this library does not move.
        CacheShapeError: vLLM's page size, head count or state shapes differ from our registry's.
    """
    layout = kv_cache_config.kv_cache_layout
    if layout is not None and layout != REQUIRED_LAYOUT:
        raise UnsupportedError(f"vLLM resolved the KV cache layout to {layout!r}; HybridNixlConnector needs "
                               f"{REQUIRED_LAYOUT!r} (an attention backend that accepts it)")
    attention, mamba = _specs(kv_cache_config)
    model = model_of(vllm_config)
    tp_size = vllm_config.parallel_config.tensor_parallel_size
    attn_layers = [n for n in kv_caches if model.layer_kinds[layer_index(n)] is LayerKind.ATTENTION]
    fa_view = kv_caches[attn_layers[0]]
    if fa_view.dim() != 4:
        raise CacheShapeError(f"attention view of {attn_layers[0]} has shape {tuple(fa_view.shape)}, expected "
                              "[kernel blocks, heads, tokens, K|V]", actual=tuple(fa_view.shape))
    conv_layout = ConvLayout(get_conv_state_layout()) if mamba is not None else ConvLayout.DS
    if conv_layout is not ConvLayout.DS:
        raise UnsupportedError("the GDN conv state must be in DS layout: set VLLM_SSM_CONV_STATE_LAYOUT=DS "
                               "on both engines")
    options = CacheOptions(
        kv_dtype=_dtype(attention.dtype),
        ssm_dtype=_dtype(mamba.dtypes[1]) if mamba is not None else None,
        block_size=attention.block_size,
        kernel_block_size=int(fa_view.shape[2]),
        conv_layout=conv_layout,
        kv_layout=KVLayout.INTERLEAVED,  # vLLM 0.33 pages: [head][token][K|V]
    )
    geometry = RankGeometry(model, tp_size, tp_rank, options)
    _check_against_registry(geometry, attention, mamba)
    groups = kv_cache_config.kv_cache_groups
    group_map = GroupMap.build(geometry.tensor_map, [g.layer_names for g in groups], kv_cache_config.transfer_group_ids)
    views = {layer_index(n): view for n, view in kv_caches.items()}
    # Slot j: layer j of every group, one byte range of vLLM's single allocation (checked view by view).
    slots = slots_from_layer_views(views, geometry.tensor_map.layer_tensor,
                                   kv_cache_config.num_blocks * geometry.page_bytes)
    cache = HybridCache.wrap(geometry, slots)
    attention_views = {layer: views[layer] for layer in geometry.model.attention_layers}
    return EngineCache(cache, group_map, attention_views)


def _check_against_registry(g: RankGeometry, attention: FullAttentionSpec, mamba: MambaSpec | None) -> None:
    def differ(what: str, ours, theirs) -> None:
        if ours != theirs:
            raise CacheShapeError(f"{what}: vLLM has {theirs}, this library's registry expects {ours}",
                                  expected=ours, actual=theirs)

    differ("KV heads per rank", g.num_kv_heads_local, attention.num_kv_heads)
    differ("attention head size", g.model.head_dim, attention.head_size)
    differ("page bytes", g.page_bytes, attention.page_size_bytes)
    if mamba is not None:
        differ("conv state dtype", g.conv_dtype, _dtype(mamba.dtypes[0]))
        differ("conv state shape", (g.conv_dim_local, g.model.conv_window), tuple(mamba.shapes[0]))
        m = g.model
        differ("recurrent state shape", (len(g.value_heads), m.linear_value_head_dim, m.linear_key_head_dim),
               tuple(mamba.shapes[1]))
        differ("state page bytes (padded)", g.page_bytes, mamba.page_size_bytes)
