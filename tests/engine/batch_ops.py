"""Worker-side helpers for the batched-read tests (test_read_batch.py), run through harness ``call``."""

from __future__ import annotations

import hashlib

import torch


def start_reads(state, key, items) -> list[str | None]:
    """Consumer.start_reads over (ticket bytes, local block ids, expected state position); errors by type name."""
    from hybrid_transfer.engine import decode_ticket
    from hybrid_transfer.engine.read_batch import Read

    errors = state.ranks[key].engine.start_reads([Read(decode_ticket(t), local, esp) for t, local, esp in items])
    return [None if e is None else type(e).__name__ for e in errors]


def cache_digest(state, key) -> str:
    """SHA-256 over every byte of a rank's cache tensors."""
    h = hashlib.sha256()
    for tensor in state.ranks[key].engine.cache.tensors:
        h.update(tensor.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


def corrupt_reads_from(state, key, peer_agent: str) -> None:
    """READs this consumer posts to ``peer_agent`` name remote addresses far outside its registered memory:
    real NIXL then refuses the whole handle (the fault under test), every other peer reads as usual."""
    agent = state.ranks[key].engine.agent
    real = agent.post_read

    def post_read(peer, local, remote):
        if peer == peer_agent:
            remote = remote.copy()
            remote[:, 0] += 1 << 46
        return real(peer, local, remote)

    agent.post_read = post_read


def read_stats(state, key) -> dict:
    """Handles, shared handles and per-request handle states of a consumer rank."""
    from hybrid_transfer.engine.agent import SharedRead

    c = state.ranks.get(key) or state.extra[f"{key}/paused"]
    c = c.engine
    return {"reads_posted": c.stats.reads_posted, "claims_sent": c.stats.claims_sent,
            "notifications_sent": c.stats.notifications_sent, "live_handles": c.agent.num_live_handles,
            "quarantined_blocks": c.num_quarantined_blocks, "packed_sources": c._pack.stats.packed_sources,
            "staged_reads": c._pack.stats.staged_reads,
            "shared": {rid: [isinstance(h, SharedRead) for h in r.handles] for rid, r in c._requests.items()},
            "states": {rid: r.state.value for rid, r in c._requests.items()}}


def agent_name(state, key) -> str:
    rank = state.ranks.get(key) or state.extra[f"{key}/paused"]
    return rank.engine.agent.name
