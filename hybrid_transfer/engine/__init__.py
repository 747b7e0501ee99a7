"""The only code that imports NIXL or ZeroMQ (DESIGN 4): handshakes, producers, consumers.

Modules: config (EngineConfig), wire (messages), side_channel (ZeroMQ), handshake (its two
tiers), agent (one NIXL agent), state (request lifecycles), peers (a consumer's producer
links), producer, consumer. Lifecycle under faults: lease (expiry on the producer's clock),
holds (a producer's holds, aborts and revocations), fences (engine step fences), quarantine
(a consumer's blocks that something may still write), revocations (a consumer's revoked tickets).
Pack mode: staging (bounded registered pools), stager (the producer's gather at hold and its
staging directory), pack_reader (the consumer's query, READ and scatter), gather_scatter (one
index copy per list on CPU or CUDA), calibrate (per-descriptor and per-byte costs for auto).
Embedding in a serving engine (issue 12): tickets (RankCard, EngineCard, issue_ticket: tickets issued
by the engine's scheduler), ticket_params (a ticket as JSON-safe request parameters), early
(completions that arrive before their hold).
Diagnostics (`hybrid-transfer doctor`): diagnostics, diagnostics_host, diagnostics_paths,
diagnostics_loopback, diagnostics_ucx.
"""

from hybrid_transfer.engine.agent import quiet_nixl_logging
from hybrid_transfer.engine.config import EngineConfig, PrepStrategy, ProgressPolicy
from hybrid_transfer.engine.consumer import Consumer
from hybrid_transfer.engine.producer import Producer
from hybrid_transfer.engine.state import FailureCause, HoldState, ReadResult, ReadState
from hybrid_transfer.engine.ticket_params import ticket_from_params, ticket_to_params
from hybrid_transfer.engine.tickets import EngineCard, RankCard, decode_rank_card, encode_rank_card, issue_ticket
from hybrid_transfer.engine.wire import Ticket, decode_ticket, encode_ticket

__all__ = [
    "Consumer", "EngineCard", "EngineConfig", "FailureCause", "HoldState", "PrepStrategy", "Producer",
    "ProgressPolicy", "RankCard", "ReadResult", "ReadState", "Ticket", "decode_rank_card", "decode_ticket",
    "encode_rank_card", "encode_ticket", "issue_ticket", "quiet_nixl_logging",
    "ticket_from_params", "ticket_to_params",
]
