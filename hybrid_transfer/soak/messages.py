"""What the soak's coordinator and its rank processes say to each other over their pipe.

Tagged msgspec Structs sent as msgpack bytes and decoded strictly against the union of one side's
types (the benchmark's scheme, bench/messages.py): a wrong field fails at the receiving end, named.
"""

from __future__ import annotations

from typing import TypeVar

import msgspec

from hybrid_transfer.errors import BenchError


class _Msg(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag=True):
    pass


# ---- commands --------------------------------------------------------------------------
class Setup(_Msg):
    """Build this process's engine: a Producer (``prefill``) or a Consumer."""

    prefill: bool
    model: str  # "tiny" or a preset name
    num_blocks: int
    engine_id: str
    incarnation: int
    lease_s: float
    heartbeat_s: float
    read_deadline_s: float
    log_level: str = "WARNING"
    read_transport: str = "nixl"  # EngineConfig.read_transport; not "nixl": the producer's cache is shared memory


class HoldItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int
    seed: int
    abort_after: int | None  # polls of this process before the embedder aborts; -1: at once; None: never


class Hold(_Msg):
    items: tuple[HoldItem, ...]


class ReadItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    key: str  # the soak's name for this read (a replayed ticket is read under a key of its own)
    ticket: bytes
    block_ids: tuple[tuple[int, ...], ...]  # local blocks
    num_tokens: int
    seed: int
    abort_after: int | None
    edit: bool = False  # read an edited copy of the ticket (its block ids shifted): must never be DONE


class Read(_Msg):
    items: tuple[ReadItem, ...]


class Connect(_Msg):
    address: str
    timeout_s: float = 30.0


class Wait(_Msg):
    """Poll until each key has ended here (consumer: reported; producer: released), or the timeout."""

    keys: tuple[str, ...]
    timeout_s: float


class Forge(_Msg):
    """From the consumer's own agent to a producer agent: unsealed Completions and Byes for live requests,
    and garbage; then a handshake from a stranger that holds a wrong secret."""

    producer_agent: str
    producer_address: str
    refs: tuple[tuple[str, int], ...]  # (request id, nonce) of live requests
    garbage: int = 8
    tickets: tuple[bytes, ...] = ()  # live tickets the second consumer (soak/rival.py) declines, aborts or reads
    seeds: tuple[int, ...] = ()  # their oracle seeds, to verify what the second consumer reads
    hostile: int = 0  # hostile kv_transfer_params drawn per ticket (soak/hostile.py)
    seed: int = 0


class Final(_Msg):
    settle_s: float


class Stop(_Msg):
    pass


Command = Setup | Hold | Read | Connect | Wait | Forge | Final | Stop


# ---- replies ---------------------------------------------------------------------------
class Ready(_Msg):
    address: str  # producer: its side-channel address; consumer: ""
    agent_name: str
    pid: int
    rss_kib: int


class Tickets(_Msg):
    tickets: tuple[bytes, ...]


class Outcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    state: str  # consumer: done / failed / aborted / raised; producer: released
    cause: str | None = None
    verified: bool | None = None  # consumer DONE: the local blocks hold exactly the oracle's bytes
    times: int = 1  # how often this key was reported (must be 1)


class Outcomes(_Msg):
    outcomes: dict[str, Outcome]  # only keys that ended


class Forged(_Msg):
    sent: int
    stranger_error: str  # the exception type the stranger's handshake raised ("" if it succeeded)
    rival: dict[str, int] = {}  # second consumer: action/outcome counts since the last report


class FinalState(_Msg):
    pinned_blocks: int
    held_requests: int
    quarantined_blocks: int
    active: int
    live_handles: int
    rss_kib: int
    rss_start_kib: int
    metrics: bytes  # msgpack of ProducerMetrics or ConsumerMetrics
    terminal: dict[str, int]
    rival: dict[str, int] = {}  # second consumer: action/outcome counts since its last report
    rival_state: dict[str, int] = {}  # second consumer at the end: active, quarantined, handles, wrong bytes, ...


class Done(_Msg):
    pass


class Failed(_Msg):
    type_name: str
    message: str


Reply = Ready | Tickets | Outcomes | Forged | FinalState | Done | Failed

_ENC = msgspec.msgpack.Encoder()
_CMD = msgspec.msgpack.Decoder(Command)
_REPLY = msgspec.msgpack.Decoder(Reply)
R = TypeVar("R")


def encode(msg: _Msg) -> bytes:
    return _ENC.encode(msg)


def decode_command(data: bytes) -> Command:
    return _CMD.decode(data)


def decode_reply(data: bytes, expected: type[R]) -> R:
    reply = _REPLY.decode(data)
    if isinstance(reply, Failed):
        raise BenchError(f"soak rank process failed: {reply.type_name}: {reply.message}")
    if not isinstance(reply, expected):
        raise BenchError(f"soak rank process answered {type(reply).__name__}, expected {expected.__name__}")
    return reply
