"""Cost model for `auto` mode: direct (coalesced) reads or pack, per source, by estimated time.

Defaults come from docs/tuning.md#measured-anchors (one H200, UCX cuda_ipc, prepared lists with
shuffled indices): ~7.5 us per unmerged descriptor, 1,755 GB/s for one large
READ, 2,130 GB/s for a device copy (bytes counted once). On a CPU host the
per-descriptor cost is ~2 us and copies run near 5.8 GB/s: pass a CostModel
built from those figures there.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybrid_transfer.plan.types import PlanMode


@dataclass(frozen=True)
class CostModel:
    """Seconds per descriptor, per byte read, per byte copied and per copied piece.

    per_descriptor_s: fixed cost of one READ descriptor (~7.5 us, docs/tuning.md#measured-anchors).
    per_byte_s: inverse bandwidth of one large READ (1 / 1,755 GB/s).
    copy_per_byte_s: inverse bandwidth of a device gather/scatter copy (1 / 2,130 GB/s).
    per_piece_copy_s: cost of one more piece in a gather/scatter kernel (index and launch share).
    copy_launch_s: fixed cost of one gather or scatter kernel.
    count_gather: whether the producer's gather is on the consumer's critical path; by default it is
        done at hold time, off that path (docs/planner.md#pack), so only the scatter counts.
    """

    per_descriptor_s: float = 7.5e-6
    per_byte_s: float = 1.0 / 1.755e12
    copy_per_byte_s: float = 1.0 / 2.13e12
    per_piece_copy_s: float = 2e-8
    copy_launch_s: float = 1e-5
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
        return self.per_descriptor_s + nbytes * self.per_byte_s + copies * copy

    def choose(self, num_descriptors: int, nbytes: int) -> PlanMode:
        """COALESCED or PACK for one source whose coalesced plan has ``num_descriptors`` rows.

        The one place ``auto`` is decided: only the planner calls it, per source, and the engine plans
        with its own (calibrated) model, so what the engine runs is what this returns.
        """
        n = num_descriptors
        return PlanMode.PACK if self.pack_s(n, nbytes) < self.direct_s(n, nbytes) else PlanMode.COALESCED
