"""Worker-side helpers for the mapped read path's tests (test_mapped.py): run inside harness workers."""

from __future__ import annotations

import hashlib


def transports(state, key) -> dict:
    """A consumer's read transports: per producer agent, READs and bytes by transport, copies per mapping."""
    c = state.ranks[key].engine
    return {"links": c.link_transports(), "reads": dict(c.reads.reads), "bytes": dict(c.reads.bytes),
            "mapped": dict(c.reads.mapped_agents), "live_handles": c.num_live_handles,
            "copies": {p: s.copies for p, s in c.reads._sources.items()},
            "metrics_transports": dict(c.metrics().transports)}


def blocks_digest(state, key, block_ids_per_group) -> str:
    """SHA-256 over the pages of the given local blocks in every shared tensor (did anything write them?)."""
    cache = state.ranks[key].engine.cache
    h = hashlib.sha256()
    for j in range(len(cache.tensors)):
        raw = cache.raw(j)
        for group in block_ids_per_group:
            for b in group:
                h.update(raw[b].cpu().numpy().tobytes())
    return h.hexdigest()


def producer_offer(state, key):
    """The MapOffer a producer rank would send (None: it offers no mapping)."""
    p = state.ranks[key].engine
    return None if p._map_offer is None else (p._map_offer.kind, len(p._map_offer.regions))


def producer_abort(state, key, request_id) -> bool:
    return state.ranks[key].engine.abort(request_id)
