"""Cost model for `auto` mode: direct (coalesced) reads or pack, by estimated time (docs/tuning.md#cost-model).

Two presets, by the memory the cache lives in, so that a shape and a geometry always get the same
choice on every rank and in every round (a per-rank start-up calibration does not: docs/planner.md#auto):

- GPU_COST: one H200, UCX cuda_ipc (docs/tuning.md#measured-anchors): ~7.5 us per unmerged
  descriptor, 1,755 GB/s for one large READ, 2,130 GB/s for a device copy, and ~1.5 ms of fixed
  cost per staged source, read off the one-H200 pack rows (docs/benchmarks.md#issue-13-final).
- HOST_COST: a 2-core CPU host over shared memory: ~2 us per descriptor, 4.6 GB/s per READ byte,
  5.8 GB/s per copied byte.

Per transport (issue 28, docs/planner.md#auto-across-transports): a link read over a mapping of the
producer's cache (engine/mapped/) plans with MAPPED_GPU_COST or MAPPED_HOST_COST, read off the copy
figures of docs/benchmarks.md#issue-28: ~0.4 us of worker thread per range and 1,590 GB/s for one gather
kernel per step on one H200; ~0.1 us per range and ~7.8 GB/s for the numpy row copy on a CPU host. A
staged source still reads its staging over NIXL and pays pack_fixed_s, so on a mapped link pack is
chosen only where direct would cost more than that fixed share: practically never.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybrid_transfer.plan.types import PlanMode


@dataclass(frozen=True)
class CostModel:
    """Seconds per descriptor, per byte read, per byte copied, per copied piece, and pack's fixed share.

    per_descriptor_s: fixed cost of one READ descriptor (~7.5 us, docs/tuning.md#measured-anchors).
    per_byte_s: inverse bandwidth of one large READ (1 / 1,755 GB/s).
    copy_per_byte_s: inverse bandwidth of a device gather/scatter copy (1 / 2,130 GB/s).
    per_piece_copy_s: cost of one more piece in a gather/scatter kernel (index and launch share).
    copy_launch_s: fixed cost of one gather or scatter kernel.
    pack_fixed_s: what a staged read of one source costs beyond its bytes, descriptors and copy: the
        wait for the producer's Staged notification, the scatter's event and the extra poll that sees
        it. On one H200 pack ran at 0.13 / 0.09 of the ceiling where direct ran at 0.25 / 0.20 with 75 /
        120 descriptors (P1->D1): 1.4-2.2 ms per request beyond the copy terms (docs/tuning.md#cost-model).
    count_gather: whether the producer's gather is on the consumer's critical path; by default it is
        done at hold time, off that path (docs/planner.md#pack), so only the scatter counts.
    """

    per_descriptor_s: float = 7.5e-6
    per_byte_s: float = 1.0 / 1.755e12
    copy_per_byte_s: float = 1.0 / 2.13e12
    per_piece_copy_s: float = 2e-8
    copy_launch_s: float = 1e-5
    pack_fixed_s: float = 1.5e-3
    count_gather: bool = False

    def direct_s(self, num_descriptors: int, nbytes: int) -> float:
        """Estimated time of reading ``nbytes`` as ``num_descriptors`` descriptors."""
        return num_descriptors * self.per_descriptor_s + nbytes * self.per_byte_s

    def pack_s(self, num_pieces: int, nbytes: int) -> float:
        """Estimated time of one READ of a staging range plus the scatter (and the gather, if counted)."""
        if num_pieces == 0:
            return 0.0
        copies = 2 if self.count_gather else 1
        copy = self.copy_launch_s + num_pieces * self.per_piece_copy_s + nbytes * self.copy_per_byte_s
        return self.pack_fixed_s + self.per_descriptor_s + nbytes * self.per_byte_s + copies * copy

    def choose(self, num_descriptors: int, nbytes: int) -> PlanMode:
        """COALESCED or PACK for one source whose direct plan has ``num_descriptors`` rows."""
        return self.choose_all((num_descriptors,), (nbytes,))

    def choose_all(self, num_descriptors: Sequence[int], nbytes: Sequence[int]) -> PlanMode:
        """COALESCED or PACK for every source of one plan at once (one mode per plan, never mixed).

        The sum compares what one consumer thread spends: its direct descriptors are posted one
        source after the other on that thread, and each staged source pays its own fixed share. The
        planner calls this once per request shape (docs/planner.md#auto), with the descriptor counts
        of the shape's fragmented direct plan.
        """
        direct = sum(self.direct_s(n, b) for n, b in zip(num_descriptors, nbytes, strict=True))
        pack = sum(self.pack_s(n, b) for n, b in zip(num_descriptors, nbytes, strict=True))
        return PlanMode.PACK if pack < direct else PlanMode.COALESCED


GPU_COST = CostModel()
HOST_COST = CostModel(per_descriptor_s=2e-6, per_byte_s=1.0 / 4.6e9, copy_per_byte_s=1.0 / 5.8e9,
                      per_piece_copy_s=5e-8, copy_launch_s=1e-5, pack_fixed_s=1e-3)


MAPPED_GPU_COST = CostModel(per_descriptor_s=4e-7, per_byte_s=1.0 / 1.59e12)
MAPPED_HOST_COST = CostModel(per_descriptor_s=1e-7, per_byte_s=1.0 / 7.8e9, copy_per_byte_s=1.0 / 5.8e9,
                             per_piece_copy_s=5e-8, copy_launch_s=1e-5, pack_fixed_s=1e-3)
TRANSPORTS = ("nixl", "mapped")


def preset_for(device_memory: bool, transport: str = "nixl") -> CostModel:
    """The preset for a cache in device (GPU) memory or in host memory, read over NIXL or a mapping."""
    if transport not in TRANSPORTS:
        raise ValueError(f"transport={transport!r} must be one of {list(TRANSPORTS)}")
    if transport == "mapped":
        return MAPPED_GPU_COST if device_memory else MAPPED_HOST_COST
    return GPU_COST if device_memory else HOST_COST
