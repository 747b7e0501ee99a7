"""What one rank tells its peers about its cache: geometry parameters plus regions.

A RankDescriptor is sent over the wire unchanged (it is the body of a
handshake); the planner rebuilds the peer's RankGeometry from it and the
shared ModelSpec, then checks the advertised sizes against its own arithmetic.
"""

from __future__ import annotations

import msgspec

from hybrid_transfer.errors import PlanError
from hybrid_transfer.layout.geometry import TOKEN_MAJOR, CacheOptions, ConvLayout, KVLayout, RankGeometry, SsmOrder
from hybrid_transfer.layout.model import DType, ModelSpec


class RankDescriptor(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A rank's cache geometry and registered regions, as its peers see it."""

    tp_size: int
    tp_rank: int
    block_size: int
    kernel_block_size: int
    kv_dtype: str
    ssm_dtype: str
    conv_layout: str
    ssm_order: str
    page_bytes: int
    num_blocks: int
    tensor_addrs: tuple[int, ...]  # base address of shared tensor j
    device_id: int = 0
    is_cuda: bool = False
    conv_segment_bytes: tuple[int, int, int] = (0, 0, 0)
    ssm_bytes: int = 0
    kv_layout: str = KVLayout.INTERLEAVED.value  # protocol 3
    conv_dtype: str = ""  # protocol 4: the conv state's dtype when an engine overrides it ("": the model dtype)
    kv_interior: str = TOKEN_MAJOR  # protocol 9: the attention kernel's page interior (docs/attention-layouts.md)
    draft_layers: int = 0  # protocol 10: MTP attention layers cached after the model's (docs/layout.md#draft-layers)
    speculative_slots: int = 0  # protocol 10: speculative tokens s, the conv window is w-1+s

    @property
    def region_bytes(self) -> int:
        return self.num_blocks * self.page_bytes


def describe_rank(geometry: RankGeometry, tensor_addrs: tuple[int, ...] | list[int], num_blocks: int,
                  *, device_id: int = 0, is_cuda: bool = False) -> RankDescriptor:
    """Describe a rank whose shared tensors start at ``tensor_addrs`` and hold ``num_blocks`` pages."""
    if len(tensor_addrs) != geometry.num_tensors:
        raise PlanError(f"{len(tensor_addrs)} tensor addresses given, geometry has {geometry.num_tensors}",
                        num_addrs=len(tensor_addrs), num_tensors=geometry.num_tensors)
    return RankDescriptor(
        tp_size=geometry.tp_size,
        tp_rank=geometry.tp_rank,
        block_size=geometry.block_size,
        kernel_block_size=geometry.kernel_block_size,
        kv_dtype=geometry.kv_dtype.value,
        ssm_dtype=geometry.ssm_dtype.value,
        conv_layout=geometry.conv_layout.value,
        ssm_order=geometry.ssm_order.value,
        page_bytes=geometry.page_bytes,
        num_blocks=num_blocks,
        tensor_addrs=tuple(int(a) for a in tensor_addrs),
        device_id=device_id,
        is_cuda=is_cuda,
        conv_segment_bytes=geometry.conv_segment_bytes,
        ssm_bytes=geometry.ssm_bytes,
        kv_layout=geometry.kv_layout.value,
        conv_dtype=geometry.conv_dtype.value,
        kv_interior=geometry.kv_interior,
        draft_layers=geometry.draft_layers,
        speculative_slots=geometry.speculative_slots,
    )


def geometry_from_descriptor(model: ModelSpec, desc: RankDescriptor) -> RankGeometry:
    """Rebuild a peer's geometry and check that its advertised sizes match our arithmetic.

    Raises:
        PlanError: the peer's page bytes, segment bytes or ssm bytes disagree.
    """
    options = CacheOptions(
        kv_dtype=DType(desc.kv_dtype),
        ssm_dtype=DType(desc.ssm_dtype),
        block_size=desc.block_size,
        kernel_block_size=desc.kernel_block_size,
        conv_layout=ConvLayout(desc.conv_layout),
        ssm_order=SsmOrder(desc.ssm_order),
        kv_layout=desc.kv_layout,
        conv_dtype=DType(desc.conv_dtype) if desc.conv_dtype else None,
        kv_interior=desc.kv_interior,
        draft_layers=desc.draft_layers,
        speculative_slots=desc.speculative_slots,
    )
    geometry = RankGeometry(model, desc.tp_size, desc.tp_rank, options)
    for name, ours, theirs in (
        ("page_bytes", geometry.page_bytes, desc.page_bytes),
        ("conv_segment_bytes", geometry.conv_segment_bytes, tuple(desc.conv_segment_bytes)),
        ("ssm_bytes", geometry.ssm_bytes, desc.ssm_bytes),
        ("num_tensors", geometry.num_tensors, len(desc.tensor_addrs)),
    ):
        if ours != theirs:
            raise PlanError(f"peer rank {desc.tp_rank} advertises {name}={theirs!r}, its geometry gives {ours!r}",
                            field=name, expected=ours, actual=theirs)
    return geometry
