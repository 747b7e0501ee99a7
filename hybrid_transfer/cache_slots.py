"""Per-slot byte tensors cut out of a serving engine's single cache allocation, without copying.

vLLM 0.33 allocates one int8 buffer per rank and places the layers of slot (shared tensor) j at
``offset + j * layer_stride``, block b at ``+ b * block_stride`` (its ``allocate_kv_cache``); every
layer sharing slot j is a typed view starting at the same byte. ``HybridCache.wrap`` wants one
contiguous uint8 tensor per slot: these helpers carve them out of that buffer, aliasing it, so
NIXL registers and reads the engine's own memory.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from hybrid_transfer.errors import CacheShapeError


def backing_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``tensor`` as a flat uint8 tensor (an alias, whatever view ``tensor`` is)."""
    storage = tensor.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(storage, 0, (storage.nbytes(),))


def carve_slots(backing: torch.Tensor, num_slots: int, slot_bytes: int, *, offset: int = 0,
                layer_stride: int | None = None) -> list[torch.Tensor]:
    """Slot j = bytes ``[offset + j * layer_stride, + slot_bytes)`` of ``backing``, as uint8 aliases.

    ``slot_bytes`` is num_blocks * page bytes; ``layer_stride`` defaults to ``slot_bytes`` (slots back to back).

    Raises:
        CacheShapeError: ``backing`` is not one contiguous tensor, a slot would overlap the next one
            or run past the end of the buffer, or a count is not positive.
    """
    if not isinstance(backing, torch.Tensor) or not backing.is_contiguous():
        raise CacheShapeError("the backing allocation must be one contiguous tensor")
    raw = backing.reshape(-1).view(torch.uint8) if backing.dtype != torch.uint8 else backing.reshape(-1)
    stride = slot_bytes if layer_stride is None else layer_stride
    for name, value in (("num_slots", num_slots), ("slot_bytes", slot_bytes)):
        if not isinstance(value, int) or value <= 0:
            raise CacheShapeError(f"{name}={value!r} must be a positive integer", actual=value)
    if not isinstance(offset, int) or offset < 0:
        raise CacheShapeError(f"offset={offset!r} must be a non-negative integer", actual=offset)
    if not isinstance(stride, int) or (num_slots > 1 and stride < slot_bytes):
        raise CacheShapeError(f"layer_stride={stride!r} is smaller than slot_bytes={slot_bytes}: slots would overlap",
                              expected=slot_bytes, actual=stride)
    end = offset + (num_slots - 1) * stride + slot_bytes
    if end > raw.numel():
        raise CacheShapeError(f"slot {num_slots - 1} ends at byte {end}, the allocation holds {raw.numel()}",
                              expected=end, actual=raw.numel())
    return [raw[offset + j * stride: offset + j * stride + slot_bytes] for j in range(num_slots)]


def slots_from_layer_views(views: Mapping[int, torch.Tensor], layer_slots: Sequence[int],
                           slot_bytes: int) -> list[torch.Tensor]:
    """One uint8 tensor per slot from the engine's per-layer views (model layer index -> view).

    Every layer of slot j must start at the same byte of one shared storage and span exactly
    ``slot_bytes`` (its first dimension times that dimension's stride); slots must not overlap.

    Raises:
        CacheShapeError: a layer missing, views on different storages or devices, two layers of a
            slot starting at different bytes, a view whose extent is not ``slot_bytes``, or slots
            that overlap.
    """
    num_layers = len(layer_slots)
    missing = [layer for layer in range(num_layers) if layer not in views]
    if missing:
        raise CacheShapeError(f"no view for layers {missing}", expected=num_layers, actual=sorted(views))
    first = views[0]
    backing = backing_bytes(first)
    base = backing.data_ptr()
    starts: dict[int, tuple[int, int]] = {}  # slot -> (start byte, first layer seen there)
    for layer in range(num_layers):
        view = views[layer]
        if view.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or view.device != first.device:
            raise CacheShapeError(f"layer {layer} does not share layer 0's allocation")
        extent = view.shape[0] * view.stride(0) * view.element_size() if view.dim() else 0
        if extent != slot_bytes:
            raise CacheShapeError(f"layer {layer}'s view spans {extent} bytes, a slot holds {slot_bytes}",
                                  expected=slot_bytes, actual=extent)
        start = view.data_ptr() - base
        slot = layer_slots[layer]
        seen = starts.setdefault(slot, (start, layer))
        if seen[0] != start:
            raise CacheShapeError(f"layers {seen[1]} and {layer} share slot {slot} but start at bytes "
                                  f"{seen[0]} and {start}", expected=seen[0], actual=start)
    slots = sorted(starts)
    if slots != list(range(len(slots))):
        raise CacheShapeError(f"layer_slots name slots {slots}, expected 0..{len(slots) - 1}", actual=slots)
    ordered = sorted((starts[s][0], s) for s in slots)
    for (a, sa), (b, sb) in zip(ordered, ordered[1:], strict=False):
        if b - a < slot_bytes:
            raise CacheShapeError(f"slots {sa} and {sb} overlap (starts {a} and {b}, {slot_bytes} bytes each)",
                                  expected=slot_bytes, actual=b - a)
    if ordered[-1][0] + slot_bytes > backing.numel():
        raise CacheShapeError("the last slot runs past the end of the allocation", expected=backing.numel(),
                              actual=ordered[-1][0] + slot_bytes)
    return [backing[starts[s][0]: starts[s][0] + slot_bytes] for s in slots]
