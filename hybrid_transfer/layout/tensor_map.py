"""Layer-to-tensor map of vLLM's hybrid (HMA) cache (docs/layout.md#the-layer-to-tensor-map).

Layers of one kind are split into groups of ``group_size`` with a stride
(group i = layers[i::num_groups]); layer j of every group lives on shared
tensor j, so there are ``group_size`` tensors in all.
"""

from __future__ import annotations

import msgspec

from hybrid_transfer.errors import UnsupportedError
from hybrid_transfer.layout.model import LayerKind, ModelSpec


class CacheGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV cache group: layers of one kind that share block ids."""

    kind: LayerKind
    layers: tuple[int, ...]  # layers[j] lives on tensor j


class TensorMap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Groups (attention groups first, then GDN groups) and each layer's tensor."""

    groups: tuple[CacheGroup, ...]
    layer_tensor: tuple[int, ...]  # indexed by model layer

    @property
    def num_tensors(self) -> int:
        return len(self.groups[0].layers)

    def tensor_of(self, layer: int) -> int:
        return self.layer_tensor[layer]

    def groups_of(self, kind: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.kind is kind)


def build_tensor_map(model: ModelSpec) -> TensorMap:
    by_kind = {kind: [i for i, k in enumerate(model.layer_kinds) if k is kind] for kind in LayerKind}
    counts = [len(v) for v in by_kind.values() if v]
    group_size = min(counts)
    groups: list[CacheGroup] = []
    layer_tensor = [0] * model.num_layers
    for kind in (LayerKind.ATTENTION, LayerKind.GDN):
        layers = by_kind[kind]
        if not layers:
            continue
        if len(layers) % group_size:
            raise UnsupportedError(
                f"{model.name}: {len(layers)} {kind.value} layers do not split into groups of {group_size}; "
                "padded groups are not supported"
            )
        num_groups = len(layers) // group_size
        for i in range(num_groups):
            members = tuple(layers[i::num_groups])
            groups.append(CacheGroup(kind=kind, layers=members))
            for j, layer in enumerate(members):
                layer_tensor[layer] = j
    return TensorMap(groups=tuple(groups), layer_tensor=tuple(layer_tensor))
