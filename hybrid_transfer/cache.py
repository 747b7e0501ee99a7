"""A rank's paged hybrid cache over real memory, with typed views per model layer.

The shared tensors are raw pages (docs/layout.md): an attention layer sees each
page as ``ratio`` consecutive kernel blocks, each ``[heads][tokens][K|V]``
(interleaved) or ``[K | V]`` halves of ``[heads][tokens][head_dim]`` (split);
a GDN layer sees the same page as [conv | ssm | padding]. The views here alias those bytes exactly,
so what a test writes through a view is what NIXL reads from the region.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from hybrid_transfer.errors import CacheShapeError, ConfigError
from hybrid_transfer.layout.geometry import ConvLayout, ConvSegment, KVLayout, RankGeometry, SsmOrder
from hybrid_transfer.layout.model import DType, LayerKind

TORCH_DTYPES = {
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
    DType.FP32: torch.float32,
    DType.FP8: torch.float8_e4m3fn,
}


class Region(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered memory region: a whole shared tensor."""

    addr: int
    length: int
    device_id: int
    is_cuda: bool = False


class HybridCache:
    """The ``num_tensors`` shared page arrays of one rank and typed views over them."""

    def __init__(self, geometry: RankGeometry, tensors: Sequence[torch.Tensor]):
        self.geometry = geometry
        self._raw = [self._check_tensor(i, t) for i, t in enumerate(tensors)]
        if len(self._raw) != geometry.num_tensors:
            raise CacheShapeError(
                f"expected {geometry.num_tensors} shared tensors for {geometry.model.name}, got {len(self._raw)}",
                expected=geometry.num_tensors,
                actual=len(self._raw),
            )
        sizes = {t.numel() for t in self._raw}
        if len(sizes) != 1:
            raise CacheShapeError(f"shared tensors differ in size: {sorted(sizes)} bytes", actual=sorted(sizes))
        devices = {t.device for t in self._raw}
        if len(devices) != 1:
            raise CacheShapeError(f"shared tensors sit on several devices: {sorted(map(str, devices))}")
        self.num_blocks = self._raw[0].numel() // geometry.page_bytes
        self.device = self._raw[0].device
        self.shared_segments = None  # allocate(shared=True): the named shared memory under the tensors

    @classmethod
    def allocate(cls, geometry: RankGeometry, num_blocks: int, device: str | torch.device = "cpu", *,
                 shared: bool = False) -> HybridCache:
        """Allocate zeroed shared tensors holding ``num_blocks`` pages each.

        ``shared``: on a CPU host, over named shared memory (engine/mapped/shm.py), so a consumer on this
        host can map it and read it without NIXL (docs/tuning.md#mapped-reads). GPU caches need no such
        allocation: CUDA IPC maps plain ones.
        """
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ConfigError(f"num_blocks={num_blocks!r} must be a positive integer", field="num_blocks",
                              value=num_blocks)
        nbytes = num_blocks * geometry.page_bytes
        if not shared:
            tensors = [torch.zeros(nbytes, dtype=torch.uint8, device=device) for _ in range(geometry.num_tensors)]
            return cls(geometry, tensors)
        if torch.device(device).type != "cpu":
            raise ConfigError(f"shared=True allocates host memory, not {device}", field="device", value=str(device))
        from hybrid_transfer.engine.mapped.shm import SharedSegments

        segments = SharedSegments(nbytes, geometry.num_tensors)
        cache = cls(geometry, [torch.frombuffer(b, dtype=torch.uint8) for b in segments.buffers])
        cache.shared_segments = segments
        return cache

    @classmethod
    def wrap(cls, geometry: RankGeometry, tensors: Sequence[torch.Tensor]) -> HybridCache:
        """Use existing tensors (e.g. the ones vLLM hands a connector), one per shared tensor."""
        return cls(geometry, tensors)

    def _check_tensor(self, index: int, tensor: torch.Tensor) -> torch.Tensor:
        if not isinstance(tensor, torch.Tensor):
            raise CacheShapeError(f"shared tensor {index} is a {type(tensor).__name__}, not a torch.Tensor")
        if not tensor.is_contiguous():
            raise CacheShapeError(f"shared tensor {index} is not contiguous")
        raw = tensor.view(torch.uint8).reshape(-1) if tensor.dtype != torch.uint8 else tensor.reshape(-1)
        page = self.geometry.page_bytes
        if raw.numel() == 0 or raw.numel() % page:
            raise CacheShapeError(
                f"shared tensor {index} holds {raw.numel()} bytes, not a positive multiple of page_bytes={page}",
                expected=page,
                actual=raw.numel(),
            )
        return raw

    # ---- raw memory ------------------------------------------------------
    def raw(self, tensor_index: int) -> torch.Tensor:
        """Shared tensor ``tensor_index`` as uint8 [num_blocks, page_bytes]."""
        return self._raw[tensor_index].view(self.num_blocks, self.geometry.page_bytes)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return list(self._raw)

    @property
    def regions(self) -> list[Region]:
        """One region per shared tensor, in tensor order: what NIXL registers."""
        dev = self.device
        device_id = (dev.index or 0) if dev.type == "cuda" else 0
        return [
            Region(addr=t.data_ptr(), length=t.numel(), device_id=device_id, is_cuda=dev.type == "cuda")
            for t in self._raw
        ]

    # ---- typed views -----------------------------------------------------
    def _layer_raw(self, layer: int, kind: LayerKind) -> torch.Tensor:
        # Cached layers: the model's, then the draft (MTP) attention layers at num_layers + i.
        got = self.geometry.layer_kind(layer)
        if got is not kind:
            raise ConfigError(f"layer {layer} is {got.value}, not {kind.value}", field="layer", value=layer)
        return self.raw(self.geometry.tensor_of(layer))

    def kv(self, layer: int) -> torch.Tensor:
        """The layout's natural view of one attention layer's kernel blocks.

        interleaved: ``[num_kernel_blocks, heads_local, kernel_block_size, 2 * head_dim]`` (K then V
        of a token side by side; vLLM 0.33's flash-attn cache shape).
        split: ``[num_kernel_blocks, 2, heads_local, kernel_block_size, head_dim]``; index 1 is K (0) or V (1).
        Use ``k`` / ``v`` for code that must not depend on the layout.
        """
        g = self.geometry
        raw = self._layer_raw(layer, LayerKind.ATTENTION)
        typed = raw.view(TORCH_DTYPES[g.kv_dtype])
        nkb, h, kbs, hd = self.num_blocks * g.kernel_ratio, g.num_kv_heads_local, g.kernel_block_size, g.model.head_dim
        if g.kv_layout is KVLayout.INTERLEAVED:
            return typed.view(nkb, h, kbs, 2 * hd)
        return typed.view(nkb, 2, h, kbs, hd)

    def k(self, layer: int) -> torch.Tensor:
        """K of one attention layer, ``[num_kernel_blocks, heads_local, kernel_block_size, head_dim]``, aliasing the cache.

        Strided in interleaved (every token's V sits between two K rows); writes land in the cache.
        """
        return self._half(layer, 0)

    def v(self, layer: int) -> torch.Tensor:
        """V of one attention layer, same shape and aliasing as ``k``."""
        return self._half(layer, 1)

    def _half(self, layer: int, half: int) -> torch.Tensor:
        hd = self.geometry.model.head_dim
        kv = self.kv(layer)
        if self.geometry.kv_layout is KVLayout.INTERLEAVED:
            return kv[..., half * hd : (half + 1) * hd]
        return kv[:, half]

    def conv(self, layer: int) -> torch.Tensor:
        """[num_blocks, conv_dim_local, w-1+s] (s: speculative slots), channels [Q_r | K_r | V_r]; a transposed view in SD layout."""
        g = self.geometry
        raw = self._layer_raw(layer, LayerKind.GDN)[:, : g.conv_bytes]
        typed = raw.view(TORCH_DTYPES[g.conv_dtype])
        w = g.conv_window
        if g.conv_layout is ConvLayout.DS:
            return typed.view(self.num_blocks, g.conv_dim_local, w)
        return typed.view(self.num_blocks, w, g.conv_dim_local).transpose(1, 2)

    def ssm(self, layer: int) -> torch.Tensor:
        """[num_blocks, nv_local, dv, dk] (or [.., dk, dv] in the older axis order)."""
        g = self.geometry
        m = g.model
        raw = self._layer_raw(layer, LayerKind.GDN)[:, g.conv_bytes : g.conv_bytes + g.ssm_bytes]
        typed = raw.view(TORCH_DTYPES[g.ssm_dtype])
        inner = (
            (m.linear_value_head_dim, m.linear_key_head_dim)
            if g.ssm_order is SsmOrder.V_D_K
            else (m.linear_key_head_dim, m.linear_value_head_dim)
        )
        return typed.view(self.num_blocks, len(g.value_heads), *inner)

    # ---- byte ranges (absolute addresses) --------------------------------
    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise ConfigError(f"block_id={block_id} out of range [0, {self.num_blocks})", field="block_id",
                              value=block_id)

    def kv_range(self, layer: int, block_id: int, kernel_index: int, half: int) -> tuple[int, int]:
        """(addr, length) of the K (half 0) or V (half 1) half of one kernel block of a logical block.

        Split layout only: in interleaved a half is not one byte range (use ``kernel_block_range``).
        """
        self._check_block(block_id)
        g = self.geometry
        if g.kv_layout is not KVLayout.SPLIT:
            raise ConfigError("a K or V half is one byte range only in the split layout", field="kv_layout",
                              value=g.kv_layout.value)
        # Unchecked, an out-of-range kernel index or half silently names bytes of another block.
        if not 0 <= kernel_index < g.kernel_ratio:
            raise ConfigError(f"kernel_index={kernel_index} out of range [0, {g.kernel_ratio})",
                              field="kernel_index", value=kernel_index)
        if half not in (0, 1):
            raise ConfigError(f"half={half} must be 0 (K) or 1 (V)", field="half", value=half)
        base = self._layer_raw(layer, LayerKind.ATTENTION).data_ptr()
        return base + g.kv_offset(block_id, kernel_index, half), g.kv_half_bytes

    def kernel_block_range(self, layer: int, block_id: int, kernel_index: int) -> tuple[int, int]:
        """(addr, length) of one whole kernel block (K and V of every local head), in either layout."""
        self._check_block(block_id)
        g = self.geometry
        if not 0 <= kernel_index < g.kernel_ratio:
            raise ConfigError(f"kernel_index={kernel_index} out of range [0, {g.kernel_ratio})",
                              field="kernel_index", value=kernel_index)
        base = self._layer_raw(layer, LayerKind.ATTENTION).data_ptr()
        return base + g.kv_offset(block_id, kernel_index, 0), g.kernel_block_bytes

    def conv_range(self, layer: int, block_id: int, segment: ConvSegment) -> tuple[int, int]:
        """(addr, length) of the Q, K or V conv segment of a state block (DS layout)."""
        self._check_block(block_id)
        g = self.geometry
        base = self._layer_raw(layer, LayerKind.GDN).data_ptr()
        return base + g.conv_segment_offset(block_id, segment), g.conv_segment_bytes[int(segment)]

    def ssm_range(self, layer: int, block_id: int) -> tuple[int, int]:
        self._check_block(block_id)
        g = self.geometry
        base = self._layer_raw(layer, LayerKind.GDN).data_ptr()
        return base + g.ssm_offset(block_id), g.ssm_bytes
