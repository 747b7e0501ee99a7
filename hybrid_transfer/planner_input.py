"""What the pure planner needs, built from a rank's HybridCache.

The planner (``plan/``) never sees torch: it takes a RankDescriptor per rank (geometry plus
region addresses) and, to run a plan without NIXL, a MemorySpace over those regions. The engine
sends ``describe_cache`` in its handshake; embedders and tests use both to plan and dry-run reads.
"""

from __future__ import annotations

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.plan.executor import MemorySpace
from hybrid_transfer.plan.rank import RankDescriptor, describe_rank


def describe_cache(cache: HybridCache) -> RankDescriptor:
    """This rank's geometry and the regions its NIXL agent registers: the planner's input for a rank."""
    regions = cache.regions
    return describe_rank(cache.geometry, [r.addr for r in regions], cache.num_blocks,
                         device_id=regions[0].device_id, is_cuda=regions[0].is_cuda)


def memory_space(cache: HybridCache, name: str | None = None) -> MemorySpace:
    """The cache's shared tensors as a MemorySpace, so ``plan.execute`` can apply plans to them (CPU only).

    Raises:
        ConfigError: the cache is not in CPU memory (plain-memory execution reads numpy views).
    """
    if cache.device.type != "cpu":
        raise ConfigError(f"memory_space needs a CPU cache, this one is on {cache.device}", field="device",
                          value=str(cache.device))
    g = cache.geometry
    space = MemorySpace(name or f"{g.model.name} tp{g.tp_rank}/{g.tp_size}")
    for tensor in cache.tensors:
        space.register(tensor.data_ptr(), tensor.numpy())
    return space
