"""Plans are data: numpy struct-of-arrays per source rank, easy to print, diff and cache."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hybrid_transfer.identity_enum import IdentityEnum
from hybrid_transfer.plan.stage_layout import StagedRead, StageLayout


class PlanMode(IdentityEnum):
    # vLLM 0.33's own scheme, the baseline: one descriptor per (shared tensor, source kernel page, destination
    # kernel page) moving whole pages (tail of the last one included), and per GDN layer conv Q, K, V and ssm.
    NAIVE = "naive"
    COALESCED = "coalesced"  # every range contiguous on both sides merged
    PACK = "pack"  # gather on the source into staging, one read, scatter on the destination
    AUTO = "auto"  # cost model chooses


@dataclass(frozen=True)
class SourcePlan:
    """The reads a consumer rank posts to one producer rank.

    ``local_addr``, ``remote_addr`` and ``length`` are int64 columns of equal
    length; row i reads ``length[i]`` bytes at ``remote_addr[i]`` on the
    source into ``local_addr[i]`` here.
    """

    source_rank: int
    local_addr: np.ndarray
    remote_addr: np.ndarray
    length: np.ndarray
    local_device: int = 0
    remote_device: int = 0

    @property
    def num_descriptors(self) -> int:
        return int(self.length.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.length.sum())

    def local_descs(self) -> np.ndarray:
        """C-contiguous Nx3 int64 (addr, length, device) array, the form NIXL copies without a Python loop."""
        return _descs(self.local_addr, self.length, self.local_device)

    def remote_descs(self) -> np.ndarray:
        return _descs(self.remote_addr, self.length, self.remote_device)


@dataclass(frozen=True)
class PackSourcePlan:
    """Pack mode for one source, exactly as the engine runs it (docs/planner.md, pack mode).

    The source gathers its whole share of the request into its staging in its own canonical order
    (``layout``, plan/stage_layout.py: the same whoever reads it); this rank posts one READ of the
    ``read`` ranges of that staging into its own staging slice, then scatters ``read``'s pieces into
    its blocks. ``direct`` holds the same bytes as coalesced rows: what the engine reads instead
    when the source staged nothing.
    """

    direct: SourcePlan
    layout: StageLayout
    read: StagedRead

    @property
    def source_rank(self) -> int:
        return self.direct.source_rank

    @property
    def num_pieces(self) -> int:
        """Scatter pieces on this rank (one index kernel copies them all)."""
        return int(self.read.scatter_length.shape[0])

    @property
    def num_descriptors(self) -> int:
        """Ranges of the source's staging in the one READ (at most two per source, see stage_layout)."""
        return self.read.num_ranges

    @property
    def total_bytes(self) -> int:
        return self.read.total_bytes

    @property
    def staged_bytes(self) -> int:
        """What the source stages for the request in all (every consumer rank's share)."""
        return self.layout.total_bytes


@dataclass(frozen=True)
class Notification:
    """A producer rank this consumer must notify, and how many consumers that producer waits for."""

    source_rank: int
    expected_consumers: int


@dataclass(frozen=True)
class ReadPlan:
    """Everything one consumer rank does for one request."""

    decode_rank: int
    mode: PlanMode
    sources: tuple[SourcePlan | PackSourcePlan, ...]
    notify: tuple[Notification, ...]
    num_tokens: int
    expected_bytes: int  # bytes the plan moves: valid payload, page-rounded attention for naive
    meta: dict = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return sum(s.total_bytes for s in self.sources)

    @property
    def num_descriptors(self) -> int:
        return sum(s.num_descriptors for s in self.sources)


def _descs(addr: np.ndarray, length: np.ndarray, device: int) -> np.ndarray:
    out = np.empty((addr.shape[0], 3), dtype=np.int64)
    out[:, 0] = addr
    out[:, 1] = length
    out[:, 2] = device
    return out
