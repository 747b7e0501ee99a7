"""Layer-to-tensor map of vLLM's hybrid (HMA) cache (docs/layout.md#the-layer-to-tensor-map).

The cached layers are the model's, then ``draft_layers`` MTP attention layers (cached layer
``num_layers + i`` is the draft module's layer i). Layers of one kind are split into groups of
``group_size`` with a stride (group i = layers[i::num_groups]); layer j of a group lives on shared
tensor j, so there are ``group_size`` tensors. A group with fewer layers than that (a padded
group) has nothing on its last tensors.
"""

from __future__ import annotations

import msgspec

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout.model import LayerKind, ModelSpec


class CacheGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One KV cache group: layers of one kind that share block ids."""

    kind: LayerKind
    layers: tuple[int, ...]  # layers[j] lives on tensor j; tensors past len(layers) hold nothing of this group


class TensorMap(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Groups (attention groups first, then GDN groups) and each cached layer's tensor."""

    groups: tuple[CacheGroup, ...]
    layer_tensor: tuple[int, ...]  # indexed by cached layer (model layers, then draft layers)
    layer_kinds: tuple[LayerKind, ...]  # indexed like layer_tensor

    @property
    def num_tensors(self) -> int:
        return max(len(g.layers) for g in self.groups)

    def tensor_of(self, layer: int) -> int:
        return self.layer_tensor[layer]

    def groups_of(self, kind: LayerKind) -> tuple[int, ...]:
        return tuple(i for i, g in enumerate(self.groups) if g.kind is kind)

    @property
    def num_cached_layers(self) -> int:
        return len(self.layer_tensor)

    def cached_layers(self) -> tuple[tuple[int, LayerKind], ...]:
        """Every cached layer (model layers, then draft layers) with its kind."""
        return tuple(enumerate(self.layer_kinds))

    def layers_of(self, kind: LayerKind) -> tuple[int, ...]:
        """Cached layers of one kind, draft layers included."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is kind)

    @property
    def group_tensors(self) -> tuple[int, ...]:
        """Per group, how many tensors (0 .. n-1) hold one of its layers: ``num_tensors`` unless padded."""
        return tuple(len(g.layers) for g in self.groups)

    @property
    def is_padded(self) -> bool:
        """Some group has no layer on some tensor."""
        return any(len(g.layers) != self.num_tensors for g in self.groups)


def group_size_of(counts: list[int]) -> int:
    """vLLM's group size for per-kind layer counts (docs/layout.md#the-layer-to-tensor-map): the smallest
    count, or the largest when that is less than 1.5 times the smallest (fewer padding layers)."""
    smallest, largest = min(counts), max(counts)
    return largest if 2 * largest < 3 * smallest else smallest


def build_tensor_map(model: ModelSpec, draft_layers: int = 0) -> TensorMap:
    """The map of ``model``'s layers plus ``draft_layers`` draft (MTP) attention layers after them.

    Raises:
        ConfigError: ``draft_layers`` is not a non-negative integer.
    """
    if isinstance(draft_layers, bool) or not isinstance(draft_layers, int) or draft_layers < 0:
        raise ConfigError(f"draft_layers={draft_layers!r} must be a non-negative integer", field="draft_layers",
                          value=draft_layers)
    kinds = (*model.layer_kinds, *(LayerKind.ATTENTION,) * draft_layers)
    by_kind = {kind: [i for i, k in enumerate(kinds) if k is kind] for kind in LayerKind}
    group_size = group_size_of([len(v) for v in by_kind.values() if v])
    groups: list[CacheGroup] = []
    layer_tensor = [0] * len(kinds)
    for kind in (LayerKind.ATTENTION, LayerKind.GDN):
        layers = by_kind[kind]
        if not layers:
            continue
        num_groups = -(-len(layers) // group_size)
        for i in range(num_groups):
            members = tuple(layers[i::num_groups])
            groups.append(CacheGroup(kind=kind, layers=members))
            for j, layer in enumerate(members):
                layer_tensor[layer] = j
    return TensorMap(groups=tuple(groups), layer_tensor=tuple(layer_tensor), layer_kinds=kinds)
