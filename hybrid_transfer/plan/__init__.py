"""Pure numpy planning of a request's reads between a consumer rank and a producer engine (docs/planner.md).

Modules, one job each:
  rank       RankDescriptor: a rank's geometry and regions as the handshake sends them
  topology   which producer ranks a consumer reads from and notifies
  templates  per-source intersections (KV heads, conv channels, value heads) as byte offsets
  pieces     per-request block-id arithmetic: token segments, KV and state pieces
  merge      vectorised coalescing of ranges contiguous on both sides
  cost       cost model for auto mode (direct vs pack)
  planner    Planner: templates once per peer engine, plan() per request
  validate   typed checks of block ids and of finished plans
  executor   applies plans to plain memory (tests, dry runs)
  scenario   fake engines and block ids for the CLI and benchmarks
  stage_layout  pack mode's canonical staging order: any consumer's share is at most two ranges
"""

from hybrid_transfer.plan.cost import CostModel
from hybrid_transfer.plan.executor import MemorySpace, execute
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.rank import RankDescriptor, describe_rank, geometry_from_descriptor
from hybrid_transfer.plan.topology import Topology
from hybrid_transfer.plan.types import Notification, PackSourcePlan, PlanMode, ReadPlan, SourcePlan
from hybrid_transfer.plan.validate import expected_bytes, validate_plan

__all__ = [
    "CostModel", "MemorySpace", "Notification", "PackSourcePlan", "PlanMode", "Planner", "RankDescriptor",
    "ReadPlan", "SourcePlan", "Topology", "describe_rank", "execute", "expected_bytes", "geometry_from_descriptor",
    "validate_plan",
]
