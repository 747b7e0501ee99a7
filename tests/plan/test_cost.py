"""Cost model: direct time grows with descriptors, pack pays a copy; the choice follows the estimates."""

from __future__ import annotations

from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.types import PlanMode


def test_design_worked_example_prefers_pack():
    """docs/planner.md#worked-example: ~750 descriptors for 149.8 MB cost ~6 ms direct against ~0.085 ms for the bytes."""
    cost = CostModel()
    direct = cost.direct_s(750, 149_836_800)
    assert 5e-3 < direct < 7e-3
    assert cost.pack_s(750, 149_836_800) < direct / 3  # pack's fixed share (1.5 ms) is most of its estimate
    assert cost.choose(750, 149_836_800) is PlanMode.PACK


def test_one_descriptor_is_never_packed():
    cost = CostModel()
    for nbytes in (1, 1 << 20, 1 << 34):
        assert cost.choose(1, nbytes) is PlanMode.COALESCED


def test_counting_the_gather_makes_pack_dearer():
    assert CostModel(count_gather=True).pack_s(100, 1 << 30) > CostModel().pack_s(100, 1 << 30)
    assert CostModel().pack_s(0, 0) == 0.0


def test_cheap_descriptors_favour_direct():
    assert CostModel(per_descriptor_s=1e-9).choose(10_000, 1 << 30) is PlanMode.COALESCED
