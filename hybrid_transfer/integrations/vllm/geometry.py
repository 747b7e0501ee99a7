"""Our view of a live vLLM cache: the rank geometry from vLLM's specs and the shared slots carved
out of vLLM's one backing allocation, without copying.

vLLM's numbers are handed to ``geometry_from_engine_spec`` as plain numbers: the engine's win
where an engine may differ from the model's config (dtypes, block sizes, kernel block size);
everything else is checked against our registry, and every disagreement is refused by name
before a NIXL agent exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.cache_slots import slots_from_layer_views
from hybrid_transfer.errors import CacheShapeError, UnsupportedError
from hybrid_transfer.integrations.vllm.groups import GroupMap, draft_layers_of, engine_groups, layer_index
from hybrid_transfer.layout.engine_spec import (
    EngineAttentionSpec,
    EngineRankSpec,
    EngineStateSpec,
    geometry_from_engine_spec,
)
from hybrid_transfer.layout.geometry import TOKEN_MAJOR, ConvLayout, KVLayout, check_kv_interior
from hybrid_transfer.layout.model import DType, LayerKind, ModelSpec, model_from_config
from hybrid_transfer.layout.tensor_map import build_tensor_map

REQUIRED_LAYOUT = "LBHNC"  # vLLM's name for [block][head][token][K|V] pages (alias HND)
# Backends whose kernels address an LBHNC head chunk token by token ([token][K|V], through its strides), so a
# partial block may move its valid tokens only. Every other backend, vLLM's CPU_ATTN among them (its kernels view
# a head chunk as [K: tokens x head_dim | V: ...] and tile it by ISA), is opaque: its partial kernel pages move
# whole (docs/attention-layouts.md#page-interiors).
TOKEN_MAJOR_BACKENDS = frozenset({"FLASH_ATTN", "FLASHINFER", "TRITON_ATTN", "FLEX_ATTENTION"})


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


def kv_interior_of(vllm_config, attention_layer_names) -> str:
    """The page interior of this rank's attention kernels: TOKEN_MAJOR, or the backend's name (and its ISA,
    which vLLM's CPU backend picks by host: ``CPU_ATTN:vec``, ``CPU_ATTN:amx``...).

    Read from the layers vLLM built (their ``attn_backend``; the CPU metadata builder sets ``isa`` before
    ``register_kv_caches``). A layer that names no backend is opaque, never assumed token-major.

    Raises:
        UnsupportedError: the attention layers run kernels of different interiors.
    """
    context = vllm_config.compilation_config.static_forward_context
    found = set()
    for name in attention_layer_names:
        layer = context.get(name)
        backend = getattr(layer, "attn_backend", None)
        backend_name = backend.get_name() if backend is not None else "unknown-backend"
        if backend_name in TOKEN_MAJOR_BACKENDS:
            found.add(TOKEN_MAJOR)
            continue
        isa = getattr(layer, "isa", None)
        found.add(check_kv_interior(f"{backend_name}:{isa}" if isinstance(isa, str) and isa else backend_name))
    if len(found) != 1:
        raise UnsupportedError(f"attention layers run kernels of different page interiors: {sorted(found)}")
    return found.pop()


def engine_rank_spec(kv_cache_config: KVCacheConfig, attention_view: torch.Tensor,
                     kv_interior: str = TOKEN_MAJOR, *, num_layers: int | None = None) -> EngineRankSpec:
    """What vLLM allocated on this rank, as plain numbers (layout/engine_spec.py).

    ``attention_view``: any attention layer's view; its dim 2 is the kernel block size.
    ``kv_interior``: the attention kernels' page interior (``kv_interior_of``).
    ``num_layers``: the model's layers, which places MTP draft layers after them (needed with MTP).
    """
    attention, mamba = _specs(kv_cache_config)
    if mamba is not None and mamba.page_size_bytes != attention.page_size_bytes:
        raise CacheShapeError(f"vLLM's state page ({mamba.page_size_bytes} B) differs from its attention page "
                              f"({attention.page_size_bytes} B): not one page array", expected=attention.page_size_bytes,
                              actual=mamba.page_size_bytes)
    starts: dict[int, int] = {}  # model layer -> byte offset of its block 0 in the backing allocation
    for tensor in kv_cache_config.kv_cache_tensors:
        for position, name in enumerate(tensor.layers):
            starts[layer_index(name, num_layers)] = tensor.offset + position * tensor.layer_stride
    slot_of_start = {start: slot for slot, start in enumerate(sorted(set(starts.values())))}
    state = None
    if mamba is not None:
        state = EngineStateSpec(conv_shape=tuple(mamba.shapes[0]), ssm_shape=tuple(mamba.shapes[1]),
                                conv_dtype=_dtype(mamba.dtypes[0]), ssm_dtype=_dtype(mamba.dtypes[1]))
    return EngineRankSpec(
        attention=EngineAttentionSpec(num_kv_heads=attention.num_kv_heads, head_size=attention.head_size,
                                      dtype=_dtype(attention.dtype), block_size=attention.block_size,
                                      kernel_block_size=int(attention_view.shape[2])),
        state=state,
        num_blocks=kv_cache_config.num_blocks,
        page_size_bytes=attention.page_size_bytes,
        layer_slots=tuple(slot_of_start[starts[layer]] for layer in sorted(starts)),
        groups=engine_groups(kv_cache_config, num_layers),
        kv_layout=KVLayout.INTERLEAVED,  # vLLM 0.33 pages: [head][token][K|V] (LBHNC)
        conv_layout=ConvLayout(get_conv_state_layout()) if mamba is not None else ConvLayout.DS,
        kv_interior=kv_interior,
        # MTP: its attention layers join the cache (padded groups follow), and the conv state widens by the
        # speculative slots (docs/layout.md#draft-layers).
        draft_layers=draft_layers_of(kv_cache_config),
        speculative_slots=mamba.num_speculative_blocks if mamba is not None else 0,
    )


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
    if attention is None:
        raise UnsupportedError("the engine has no full-attention cache group")
    if mamba is not None and mamba.mamba_cache_mode not in ("none", "align"):
        # "none" (no prefix caching) and "align" (vLLM's default with prefix caching) keep one running state
        # block per request at a position the scheduler knows (scheduler.state_block_index).
        raise UnsupportedError(f"GDN state with mamba_cache_mode={mamba.mamba_cache_mode!r}: HybridNixlConnector "
                               "moves the states of modes 'none' and 'align' (docs/vllm.md#prefix-caching)")
    if mamba is not None and mamba.num_speculative_blocks and mamba.mamba_cache_mode == "align":
        # Where align mode keeps the running state among speculative blocks was not measured: refused, not guessed.
        raise UnsupportedError(f"GDN state with {mamba.num_speculative_blocks} speculative blocks and "
                               "mamba_cache_mode='align': speculative decoding with prefix caching is not supported; "
                               "start both engines with --no-enable-prefix-caching (docs/vllm.md#speculative-decoding)")
    return attention, mamba


def wrap_engine_cache(vllm_config, kv_cache_config: KVCacheConfig, kv_caches: dict[str, torch.Tensor],
                      tp_rank: int) -> EngineCache:
    """Build the geometry from vLLM's live specs and wrap its allocation as our shared slots.

    Raises:
        UnsupportedError: a layout, group or spec this library does not move.
        EngineSpecMismatch: vLLM's heads, state shapes, layer-to-slot map, groups, block sizes or
            page size differ from the registry's (every difference named).
    """
    layout = kv_cache_config.kv_cache_layout
    if layout is not None and layout != REQUIRED_LAYOUT:
        raise UnsupportedError(f"vLLM resolved the KV cache layout to {layout!r}; HybridNixlConnector needs "
                               f"{REQUIRED_LAYOUT!r} (an attention backend that accepts it)")
    model = model_of(vllm_config)
    views = {layer_index(n, model.num_layers): view for n, view in kv_caches.items()}
    # The cached attention layers, MTP's draft layers after the model's (layout/tensor_map.py says which).
    attention = set(build_tensor_map(model, draft_layers_of(kv_cache_config)).layers_of(LayerKind.ATTENTION))
    attention_names = [n for n in kv_caches if layer_index(n, model.num_layers) in attention]
    spec = engine_rank_spec(kv_cache_config, views[model.attention_layers[0]],
                            kv_interior_of(vllm_config, attention_names), num_layers=model.num_layers)
    # Either conv layout moves (docs/vllm.md#conv-layout): DS in one range per Q/K/V segment, SD in one per
    # segment and window row when the TP sizes differ (one range in all at equal TP). The handshake refuses
    # two sides that differ.
    geometry = geometry_from_engine_spec(model, vllm_config.parallel_config.tensor_parallel_size, tp_rank, spec)
    group_map = GroupMap.build(geometry.tensor_map, kv_cache_config, model.num_layers)
    # Slot j: layer j of every group, one byte range of vLLM's single allocation (checked view by view).
    slots = slots_from_layer_views(views, geometry.tensor_map.layer_tensor,
                                   kv_cache_config.num_blocks * geometry.page_bytes)
    cache = HybridCache.wrap(geometry, slots)
    attention_views = {layer: views[layer] for layer in sorted(attention)}  # the draft layers' too
    return EngineCache(cache, group_map, attention_views)
