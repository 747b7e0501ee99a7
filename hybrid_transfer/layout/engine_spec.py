"""Geometry from a live serving engine: what it allocated, checked against the model registry.

A serving engine (vLLM) decides the cache it allocates: head counts, dtypes (its conv or ssm
dtype may differ from the model config's), block sizes, padded page size, its own layer-to-slot
map and group order. ``EngineRankSpec`` holds those plain numbers for one rank;
``geometry_from_engine_spec`` checks each against this library's registry, names every
disagreement in one ``EngineSpecMismatch``, and returns the ``RankGeometry`` with the engine's
dtypes and layouts, so the fingerprint states what the memory really holds. Pure: no torch, no
engine import; the embedder translates the engine's objects into these structs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from hybrid_transfer.errors import ConfigError, EngineSpecMismatch
from hybrid_transfer.layout.geometry import TOKEN_MAJOR, CacheOptions, ConvLayout, KVLayout, RankGeometry, SsmOrder
from hybrid_transfer.layout.model import DType, LayerKind, ModelSpec
from hybrid_transfer.layout.tensor_map import TensorMap, build_tensor_map


def _dtype(struct: msgspec.Struct, name: str) -> None:
    """Accept a DType, or a dtype name as engines print it ("bfloat16", "torch.float32")."""
    value = getattr(struct, name)
    if value is not None and not isinstance(value, DType):
        if not isinstance(value, str):
            raise ConfigError(f"{name}={value!r} must be a dtype name or DType", field=name, value=value)
        msgspec.structs.force_setattr(struct, name, DType.parse(value, field=name))


def _enum(struct: msgspec.Struct, name: str, enum_type: type) -> None:
    value = getattr(struct, name)
    if isinstance(value, enum_type):
        return
    try:
        msgspec.structs.force_setattr(struct, name, enum_type(value))
    except ValueError:
        known = [m.value for m in enum_type]
        raise ConfigError(f"{name}={value!r} is not one of {known}", field=name, value=value) from None


class EngineAttentionSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's attention layers as the engine allocated them (every attention layer alike).

    num_kv_heads: KV heads on this rank (a replicated head counts once). block_size: the logical
    block in tokens; kernel_block_size: the attention kernel's block (None: the logical one).
    """

    num_kv_heads: int
    head_size: int
    dtype: DType
    block_size: int
    kernel_block_size: int | None = None

    def __post_init__(self) -> None:
        _dtype(self, "dtype")


class EngineStateSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One rank's GDN state per layer: the conv and recurrent (ssm) arrays of one block, per the engine.

    conv_shape: (channels, window) in DS layout or (window, channels) in SD; ssm_shape:
    (value heads, dv, dk) in the current vLLM order or (value heads, dk, dv) in the older one.
    """

    conv_shape: tuple[int, ...]
    ssm_shape: tuple[int, ...]
    conv_dtype: DType
    ssm_dtype: DType

    def __post_init__(self) -> None:
        _dtype(self, "conv_dtype")
        _dtype(self, "ssm_dtype")


class EngineGroup(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One of the engine's cache groups: layers of one kind that share block ids."""

    kind: LayerKind
    layers: tuple[int, ...]  # model layer indices

    def __post_init__(self) -> None:
        _enum(self, "kind", LayerKind)


class EngineRankSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything one rank's engine knows of its cache (see the module docstring).

    page_size_bytes: bytes of one block of one slot, padding included (the engine's padded
    page). layer_slots: indexed by cached layer (the model's, then the draft layers), the slot
    (shared tensor) that holds it. groups: the engine's cache groups in the engine's order
    (block-id tuples follow it); a draft (MTP) layer i is layer ``num_layers + i`` in both.
    draft_layers / speculative_slots: MTP's cached attention layers and speculative tokens
    (docs/layout.md#draft-layers).
    """

    attention: EngineAttentionSpec
    state: EngineStateSpec | None
    num_blocks: int
    page_size_bytes: int
    layer_slots: tuple[int, ...]
    groups: tuple[EngineGroup, ...]
    kv_layout: KVLayout
    conv_layout: ConvLayout = ConvLayout.DS
    ssm_order: SsmOrder = SsmOrder.V_D_K
    kv_interior: str = TOKEN_MAJOR  # the attention kernel's page interior (docs/attention-layouts.md#page-interiors)
    draft_layers: int = 0
    speculative_slots: int = 0

    def __post_init__(self) -> None:
        _enum(self, "kv_layout", KVLayout)
        _enum(self, "conv_layout", ConvLayout)
        _enum(self, "ssm_order", SsmOrder)


def expected_state_shapes(geometry: RankGeometry) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(conv shape, ssm shape) of one block of one GDN layer, in the geometry's layouts (engine convention).

    The conv window is w-1 plus the speculative slots, as the engine widens it for MTP."""
    m = geometry.model
    conv = (geometry.conv_dim_local, geometry.conv_window)
    if geometry.conv_layout is ConvLayout.SD:
        conv = conv[::-1]
    heads = len(geometry.value_heads)
    ssm = ((heads, m.linear_value_head_dim, m.linear_key_head_dim) if geometry.ssm_order is SsmOrder.V_D_K
           else (heads, m.linear_key_head_dim, m.linear_value_head_dim))
    return conv, ssm


def geometry_from_engine_spec(model: ModelSpec, tp_size: int, tp_rank: int, spec: EngineRankSpec) -> RankGeometry:
    """The rank's geometry with the engine's dtypes, block sizes and layouts, once every check passes.

    Raises:
        ShardingError: ``tp_size`` / ``tp_rank`` cannot shard the model.
        EngineSpecMismatch: every disagreement between the engine and the registry, each named
            (``num_kv_heads``, ``head_size``, ``state``, ``conv_shape``, ``ssm_shape``, ``layer_slots``,
            ``groups``, ``block_size``, ``page_size``, ``num_blocks``), with both values.
    """
    if not isinstance(spec, EngineRankSpec):
        raise ConfigError(f"spec must be an EngineRankSpec, got {type(spec).__name__}", field="spec")
    attn, state = spec.attention, spec.state
    options = CacheOptions(
        kv_dtype=attn.dtype, ssm_dtype=state.ssm_dtype if state is not None else None,
        conv_dtype=state.conv_dtype if state is not None else None,
        block_size=attn.block_size, kernel_block_size=attn.kernel_block_size, conv_layout=spec.conv_layout,
        ssm_order=spec.ssm_order, kv_layout=spec.kv_layout, kv_interior=spec.kv_interior,
        draft_layers=spec.draft_layers, speculative_slots=spec.speculative_slots,
    )
    differences: list[tuple[str, Any, Any]] = []  # (field, engine, registry)
    # Sharding is checked on a geometry with default block sizes, so a bad block size is reported
    # as one more difference below rather than hiding the others.
    reference = RankGeometry(model, tp_size, tp_rank, msgspec.structs.replace(options, block_size=None,
                                                                             kernel_block_size=None))
    if attn.num_kv_heads != reference.num_kv_heads_local:
        differences.append(("num_kv_heads", attn.num_kv_heads, reference.num_kv_heads_local))
    if attn.head_size != model.head_dim:
        differences.append(("head_size", attn.head_size, model.head_dim))
    if reference.has_gdn != (state is not None):
        differences.append(("state", state is not None, reference.has_gdn))
    elif state is not None:
        conv, ssm = expected_state_shapes(reference)
        if tuple(state.conv_shape) != conv:
            differences.append(("conv_shape", tuple(state.conv_shape), conv))
        if tuple(state.ssm_shape) != ssm:
            differences.append(("ssm_shape", tuple(state.ssm_shape), ssm))
    tensor_map = reference.tensor_map
    if tuple(spec.layer_slots) != tensor_map.layer_tensor:
        differences.append(("layer_slots", tuple(spec.layer_slots), tensor_map.layer_tensor))
    try:
        engine_group_order(tensor_map, spec.groups)
    except ConfigError:
        differences.append(("groups", _group_sets(spec.groups), _group_sets(tensor_map.groups)))
    if not isinstance(spec.num_blocks, int) or spec.num_blocks <= 0:
        differences.append(("num_blocks", spec.num_blocks, "a positive integer"))
    geometry = None
    try:
        geometry = RankGeometry(model, tp_size, tp_rank, options)
    except ConfigError as exc:
        differences.append(("block_size", (attn.block_size, attn.kernel_block_size), str(exc)))
    if geometry is not None and spec.page_size_bytes != geometry.page_bytes:
        differences.append(("page_size", spec.page_size_bytes, geometry.page_bytes))
    if differences:
        raise EngineSpecMismatch(differences)
    return geometry


def engine_group_order(tensor_map: TensorMap, engine_groups: Sequence[EngineGroup]) -> tuple[int, ...]:
    """Where each of our groups sits in the engine's order: ``order[i]`` is the engine index of our group i.

    Ours put attention groups first (tensor_map.groups); an engine may not (vLLM 0.33 listed a
    tiny Qwen3-Next as GDN, GDN, GDN, attention). Reorder the engine's per-group block ids with
    ``[engine_ids[j] for j in order]``.

    Raises:
        ConfigError: the engine's groups are not ours in some order (``field="groups"``).
    """
    ours = [(g.kind, frozenset(g.layers)) for g in tensor_map.groups]
    theirs = [(LayerKind(g.kind), frozenset(g.layers)) for g in engine_groups]
    if len(theirs) != len(ours) or len(set(theirs)) != len(theirs) or set(theirs) != set(ours):
        raise ConfigError(f"engine groups {_group_sets(engine_groups)} are not the registry's "
                          f"{_group_sets(tensor_map.groups)} in any order", field="groups",
                          value=_group_sets(engine_groups))
    return tuple(theirs.index(key) for key in ours)


def to_our_group_order(engine_block_ids: Sequence[Sequence[int]], order: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """Per-group block ids in the engine's order -> in ours (``order`` from ``engine_group_order``)."""
    if len(engine_block_ids) != len(order):
        raise ConfigError(f"{len(engine_block_ids)} groups of block ids, the engine has {len(order)}",
                          field="block_ids", value=len(engine_block_ids))
    return tuple(tuple(int(b) for b in engine_block_ids[j]) for j in order)


def to_engine_group_order(our_block_ids: Sequence[Sequence[int]], order: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """The inverse of ``to_our_group_order``: per-group block ids in our order -> in the engine's."""
    if len(our_block_ids) != len(order):
        raise ConfigError(f"{len(our_block_ids)} groups of block ids, the engine has {len(order)}",
                          field="block_ids", value=len(our_block_ids))
    out: list[tuple[int, ...]] = [()] * len(order)
    for ours, j in enumerate(order):
        out[j] = tuple(int(b) for b in our_block_ids[ours])
    return tuple(out)


def engine_groups_of(model: ModelSpec, draft_layers: int = 0) -> tuple[EngineGroup, ...]:
    """The registry's own groups as EngineGroups (attention first): what a matching engine reports, reordered."""
    return tuple(EngineGroup(kind=g.kind, layers=g.layers) for g in build_tensor_map(model, draft_layers).groups)


def _group_sets(groups: Sequence[Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((LayerKind(g.kind).value, tuple(sorted(g.layers))) for g in groups)
