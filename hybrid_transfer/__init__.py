"""hybrid_transfer: move a hybrid model's cache (paged KV + GDN state) from prefill to decode over NIXL.

Layers, imports pointing down:
  layout/       pure shapes and geometry of the paged hybrid cache (docs/layout.md)
  cache         typed torch views over a rank's real pages
  plan/         pure numpy planning of reads between ranks (docs/planner.md)
  planner_input a cache as the planner sees it: RankDescriptor and MemorySpace
  engine/       the only code that imports NIXL or ZeroMQ (docs/lifecycle.md, docs/wire.md)
  integrations/ the only code that imports vLLM
  bench/, doctor/, cli/  the microbenchmark, the host checks (NIXL through engine's agent), the command line
"""

from hybrid_transfer.errors import HybridTransferError
from hybrid_transfer.layout import CacheOptions, RankGeometry, kernel_block_ids, load_preset

# Imported on first use: they pull in torch, ZeroMQ and (when used) NIXL, which pure layout users skip.
_LAZY = {
    "HybridCache": "hybrid_transfer.cache",
    "Consumer": "hybrid_transfer.engine",
    "EngineConfig": "hybrid_transfer.engine",
    "Producer": "hybrid_transfer.engine",
    "Ticket": "hybrid_transfer.engine",
    "ReadState": "hybrid_transfer.engine",
    "FailureCause": "hybrid_transfer.engine",
    "quiet_nixl_logging": "hybrid_transfer.engine",
    "describe_cache": "hybrid_transfer.planner_input",
    "memory_space": "hybrid_transfer.planner_input",
    # Embedding in a serving engine (docs/embedding.md): a scheduler issues tickets from its ranks' cards.
    "EngineCard": "hybrid_transfer.engine",
    "RankCard": "hybrid_transfer.engine",
    "issue_ticket": "hybrid_transfer.engine",
    "encode_rank_card": "hybrid_transfer.engine",
    "decode_rank_card": "hybrid_transfer.engine",
    "ticket_to_params": "hybrid_transfer.engine",
    "ticket_from_params": "hybrid_transfer.engine",
    "encode_ticket": "hybrid_transfer.engine",
    "decode_ticket": "hybrid_transfer.engine",
    "EngineRankSpec": "hybrid_transfer.layout.engine_spec",
    "EngineAttentionSpec": "hybrid_transfer.layout.engine_spec",
    "EngineStateSpec": "hybrid_transfer.layout.engine_spec",
    "geometry_from_engine_spec": "hybrid_transfer.layout.engine_spec",
    "EngineGroup": "hybrid_transfer.layout.engine_spec",
    "engine_group_order": "hybrid_transfer.layout.engine_spec",
    "to_our_group_order": "hybrid_transfer.layout.engine_spec",
    "to_engine_group_order": "hybrid_transfer.layout.engine_spec",
    "carve_slots": "hybrid_transfer.cache_slots",
    "slots_from_layer_views": "hybrid_transfer.cache_slots",
    "ReadResult": "hybrid_transfer.engine",
}

__all__ = ["CacheOptions", "HybridTransferError", "RankGeometry", "kernel_block_ids", "load_preset", *_LAZY]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'hybrid_transfer' has no attribute {name!r}")
