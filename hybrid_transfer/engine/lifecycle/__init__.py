"""Request lifecycle bookkeeping of the engine: what a producer holds and a consumer reads, under faults.

No NIXL, no sockets: the Producer and Consumer feed these what arrives and act on what they hand
back, on an injected clock (docs/lifecycle.md).

Modules: state (ReadState, HoldState, FailureCause, ReadResult and ``transition``, the only place a
state changes), holds (a producer rank's holds, pins, aborts and revocations), lease (expiry on the
producer's clock), fences (engine step fences), quarantine (a consumer's blocks that a READ or an
engine step may still write), revocations (a consumer's memory of revoked tickets), early
(completions that reach a producer before its hold), pending (handshakes awaiting a Hello).
"""
