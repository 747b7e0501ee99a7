"""vLLM's cache groups, as the engine-spec structs describe them, and their order mapped onto ours.

vLLM orders groups its own way (for Qwen3-Next the GDN groups come first) and block-id tuples
follow that order, one list per group (transfer or not). Ours put attention groups first;
``engine_group_order`` (layout/engine_spec.py) matches the two by layer sets.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec

from hybrid_transfer.errors import UnsupportedError
from hybrid_transfer.layout.engine_spec import EngineGroup, engine_group_order, to_our_group_order
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.layout.tensor_map import TensorMap

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")
_DRAFT_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)(?:\.|$)")  # an MTP module's layer: not model layer N


def layer_index(layer_name: str, num_layers: int | None = None) -> int:
    """Cached layer of a vLLM layer name: ``model.layers.3.self_attn.attn`` is model layer 3; the MTP module's
    ``mtp.layers.0.self_attn.attn`` is draft layer 0, cached layer ``num_layers + 0`` (docs/layout.md#draft-layers).

    Raises:
        UnsupportedError: a name with no layer index, or a draft layer when ``num_layers`` is not given.
    """
    draft = _DRAFT_LAYER.search(layer_name)
    if draft is not None:
        if num_layers is None:
            raise UnsupportedError(f"vLLM layer {layer_name!r} is an MTP draft layer: the model's layer count "
                                   "is needed to place it")
        return num_layers + int(draft.group(1))
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise UnsupportedError(f"vLLM layer name {layer_name!r} carries no layer index")
    return int(match.group(1))


def draft_layers_of(kv_cache_config: KVCacheConfig) -> int:
    """How many MTP draft layers hold a cache (speculative decoding with ``qwen3_next_mtp``)."""
    names = {n for g in kv_cache_config.kv_cache_groups for n in g.layer_names if _DRAFT_LAYER.search(n)}
    return len(names)


def engine_groups(kv_cache_config: KVCacheConfig, num_layers: int | None = None) -> tuple[EngineGroup, ...]:
    """vLLM's transfer groups, in vLLM's order (``num_layers``: the model's, which places draft layers).

    Raises:
        UnsupportedError: a group that is neither full attention nor GDN state (sliding window, MLA...).
    """
    groups = []
    for gid in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        if isinstance(spec, FullAttentionSpec):
            kind = LayerKind.ATTENTION
        elif isinstance(spec, MambaSpec):
            kind = LayerKind.GDN
        else:
            raise UnsupportedError(f"cache group {gid} has spec {type(spec).__name__}: only full attention and "
                                   "GDN state groups are supported (no sliding window, MLA or others)")
        groups.append(EngineGroup(kind=kind, layers=tuple(layer_index(n, num_layers) for n in group.layer_names)))
    return tuple(groups)


@dataclass(frozen=True)
class GroupMap:
    """Translates vLLM's per-group block-id tuples (all of vLLM's groups) into ours.

    ``order[i]``: the index, among vLLM's transfer groups, of our group i.
    """

    order: tuple[int, ...]
    transfer_ids: tuple[int, ...]
    num_vllm_groups: int
    attention_mask: tuple[bool, ...]  # per our group: attention (True) or state

    @classmethod
    def build(cls, tensor_map: TensorMap, kv_cache_config: KVCacheConfig, num_layers: int | None = None) -> GroupMap:
        """Raises ConfigError (``field="groups"``) when vLLM's groups are not ours in some order."""
        order = engine_group_order(tensor_map, engine_groups(kv_cache_config, num_layers))
        mask = tuple(g.kind is LayerKind.ATTENTION for g in tensor_map.groups)
        return cls(order, tuple(kv_cache_config.transfer_group_ids), len(kv_cache_config.kv_cache_groups), mask)

    def to_ours(self, vllm_block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """Block ids per vLLM group (all groups, vLLM order) -> per our group."""
        if len(vllm_block_ids) != self.num_vllm_groups:
            raise UnsupportedError(f"expected block ids for {self.num_vllm_groups} vLLM groups, "
                                   f"got {len(vllm_block_ids)}")
        return to_our_group_order([vllm_block_ids[g] for g in self.transfer_ids], self.order)
