"""The only code that imports NIXL or ZeroMQ (docs/lifecycle.md): handshakes, producers, consumers.

Transport core: config (EngineConfig), wire (messages and their version log), side_channel
(ZeroMQ), handshake (its two tiers), agent (one NIXL agent; XferState of a READ handle), peers (a
consumer's producer links), peer_record (one record per peer agent, one stage), inbox (a bounded
amount of notifications per poll). The two ends built on it: producer, consumer (with consumer_notes:
its notifications to and from producer agents, declines: tickets it will not read, read_batch: a
step's reads posted together, issue 20).
lifecycle/ (request bookkeeping: no NIXL, no sockets, the engine's injected clock): state (request
states and the one transition function), holds (a producer's holds, aborts and revocations), lease
(expiry on the producer's clock), fences (engine step fences), quarantine (a consumer's blocks that
something may still write), revocations (a consumer's revoked tickets), early (completions that
arrive before their hold), pending (handshakes awaiting a Hello).
Pack mode lives in the pack subpackage (engine/pack/__init__.py): it runs the plan layer's
PackSourcePlan, it does not model pack a second time.
Embedding in a serving engine (issue 12): tickets (RankCard, EngineCard, issue_ticket: tickets issued
by the engine's scheduler), ticket_params (a ticket as JSON-safe request parameters), inputs
(hold/start_read arguments), log_gate (repeated warnings aggregated), metrics (snapshots of a rank),
prometheus (their export; the engine never imports it).
Trust (issue 14): auth (shared secret, challenge-response, link keys, sealed notifications),
claims (single-use tickets confirmed before DONE, a producer's memory of ended tickets).
The doctor (`hybrid-transfer doctor`) lives in hybrid_transfer.doctor and reaches NIXL through agent.
"""

# Imported on first use, so that a process needing one module (the doctor's loopback children need
# only agent and config) does not pay for torch through producer and consumer.
_LAZY = {
    "EngineConfig": "config", "PrepStrategy": "config", "ProgressPolicy": "config",
    "Consumer": "consumer", "Producer": "producer", "Read": "read_batch",
    "FailureCause": "lifecycle.state", "HoldState": "lifecycle.state",
    "ReadResult": "lifecycle.state", "ReadState": "lifecycle.state",
    "Ticket": "wire", "decode_ticket": "wire", "encode_ticket": "wire",
    "quiet_nixl_logging": "agent",
    "ticket_from_params": "ticket_params", "ticket_to_params": "ticket_params",
    "EngineCard": "tickets", "RankCard": "tickets", "decode_rank_card": "tickets",
    "encode_rank_card": "tickets", "issue_ticket": "tickets",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"hybrid_transfer.engine.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hybrid_transfer.engine' has no attribute {name!r}")
