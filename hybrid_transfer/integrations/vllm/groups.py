"""vLLM's cache groups and single backing allocation, mapped onto our groups and shared slots.

vLLM orders groups its own way (for Qwen3-Next the GDN groups come first) and puts every layer
in one int8 allocation (``KVCacheTensor``: layer ``l`` of a tensor at ``offset + l * layer_stride``).
Ours: attention groups first, and slot ``j`` holds layer ``j`` of every group. This module checks
that the two agree layer by layer and translates block-id tuples between the two orders.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from hybrid_transfer.errors import UnsupportedError
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.layout.tensor_map import TensorMap

_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def layer_index(layer_name: str) -> int:
    """Model layer of a vLLM layer name such as ``model.layers.3.self_attn.attn``."""
    match = _LAYER_INDEX.search(layer_name)
    if match is None:
        raise UnsupportedError(f"vLLM layer name {layer_name!r} carries no layer index")
    return int(match.group(1))


@dataclass(frozen=True)
class GroupMap:
    """Our group ``i`` is vLLM transfer group ``ours_to_vllm[i]`` (an index into the transfer groups).

    ``num_vllm_groups``: all of vLLM's groups (block-id tuples from the scheduler have one list each);
    ``transfer_ids``: which of them take part in transfers, in vLLM order.
    """

    ours_to_vllm: tuple[int, ...]
    transfer_ids: tuple[int, ...]
    num_vllm_groups: int
    attention_mask: tuple[bool, ...]  # per our group: attention (True) or state

    @classmethod
    def build(cls, tensor_map: TensorMap, group_layer_names: Sequence[Sequence[str]],
              transfer_ids: Sequence[int]) -> GroupMap:
        """Match vLLM's transfer groups (layer names, vLLM order) to ours by their layer sets.

        Raises:
            UnsupportedError: a vLLM group with no counterpart (the message names its layers).
        """
        transfer_ids = tuple(transfer_ids)
        vllm_sets = [frozenset(layer_index(n) for n in group_layer_names[g]) for g in transfer_ids]
        ours = [frozenset(g.layers) for g in tensor_map.groups]
        if sorted(map(sorted, vllm_sets)) != sorted(map(sorted, ours)):
            raise UnsupportedError(
                f"vLLM's cache groups {[sorted(s) for s in vllm_sets]} do not match this model's "
                f"groups {[sorted(s) for s in ours]} (layer indices)")
        ours_to_vllm = tuple(vllm_sets.index(s) for s in ours)
        mask = tuple(g.kind is LayerKind.ATTENTION for g in tensor_map.groups)
        return cls(ours_to_vllm, transfer_ids, len(group_layer_names), mask)

    def to_ours(self, vllm_block_ids: Sequence[Sequence[int]]) -> tuple[tuple[int, ...], ...]:
        """Block ids per vLLM group (all groups, vLLM order) -> per our group."""
        if len(vllm_block_ids) != self.num_vllm_groups:
            raise UnsupportedError(f"expected block ids for {self.num_vllm_groups} vLLM groups, "
                                   f"got {len(vllm_block_ids)}")
        transfer = [vllm_block_ids[g] for g in self.transfer_ids]
        return tuple(tuple(int(b) for b in transfer[i]) for i in self.ours_to_vllm)
