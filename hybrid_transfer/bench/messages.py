"""What the benchmark's coordinator and its rank processes say to each other over their pipe.

Every command and every reply is a tagged msgspec Struct, sent as msgpack bytes and decoded strictly
against the union of its side's types: a misspelt field, a missing one or a wrong type fails at the
receiving end with a message naming it, instead of reaching a handler as a shifted positional argument.
The coordinator sends one Command at a time and reads one Reply; the worker answers every command
except Stop and Shutdown.
"""

from __future__ import annotations

from typing import TypeVar, Union

import msgspec

from hybrid_transfer.bench.spec import Device
from hybrid_transfer.bench.stats import ConsumerRun, PlanTiming, ProducerServe
from hybrid_transfer.errors import BenchError
from hybrid_transfer.plan.rank import RankDescriptor
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout


class RankSetup(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Everything a rank process needs to build its cache and engine."""

    preset: str
    kv_dtype: str | None  # key of spec.KV_DTYPES; None: the model dtype
    is_prefill: bool
    tp_size: int
    tp_rank: int
    num_blocks: int
    device: Device
    gpu: int
    torch_threads: int
    engine_id: str
    incarnation: int
    mode: PlanMode  # the run's chosen plan mode (producers are built with it)
    log_level: str = "WARNING"
    poll_sleep_s: float = 0.0  # decode ranks' wait between polls that found nothing (0: spin with sched_yield)
    staging_bytes: int = 256 << 20  # pack / auto staging pool (sizing.staging_bytes)
    backend_threads: int | None = None  # EngineConfig.num_backend_threads (None: its default)
    kv_layout: str = "interleaved"  # KVLayout value of both sides
    split_batch_size: int | None = None  # EngineConfig.split_batch_size (None: its default)
    post_thread: bool | None = None  # EngineConfig.post_thread (None: its default)
    serve_sleep_s: float = 0.001  # prefill ranks' wait between polls in a timed window (0: spin with sched_yield)
    read_batching: str = "per_step"  # EngineConfig.read_batching of decode ranks
    secret_file: str | None = None  # EngineConfig.secret_file of every rank (the mapped path needs a secret)
    shared_cache: bool = False  # a CPU cache over named shared memory, so a consumer can map it (engine/mapped/)

    def engine_config(self, **fields):
        """The EngineConfig of this rank's agents: the run's UCX backend settings, plus ``fields``."""
        from hybrid_transfer.engine.config import EngineConfig

        return EngineConfig(num_backend_threads=self.backend_threads, split_batch_size=self.split_batch_size,
                            post_thread=self.post_thread, read_batching=self.read_batching,
                            secret_file=self.secret_file, **fields)


class EngineItem(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One request as a decode rank reads it."""

    request_id: str
    ticket: bytes  # wire.encode_ticket of the producers' ticket
    local_block_ids: tuple[tuple[int, ...], ...]
    num_tokens: int


class CeilingSource(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A prefill rank's ceiling buffer, as a decode rank that reads it needs to know it."""

    rank: int
    metadata: bytes  # the prefill rank's ceiling agent metadata
    base: int
    slot_bytes: int
    device_id: int
    seed: int  # its fill pattern's seed, for the check


# ---- commands (coordinator -> rank process) -------------------------------------------------
class Command(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="command", tag=True):
    """Base of every command; the tag is the class name."""


class Setup(Command):
    """Allocate the cache; a prefill rank builds its Producer and answers Started, a decode rank Done."""

    rank: RankSetup


class SetEngineAddresses(Command):
    """A multi-rank prefill engine: every rank's side-channel address, in rank order."""

    addresses: list[str]


class Fill(Command):
    """Write each request's pattern (seeded) into its source blocks."""

    layouts: list[RequestLayout]
    seeds: list[int]


class Hold(Command):
    """Hold requests; rank 0 draws the nonces (None), the other ranks reuse them. Answers Held."""

    request_ids: list[str]
    layouts: list[RequestLayout]
    nonces: list[int] | None = None


class Serve(Command):
    """A prefill rank's timed window: poll until these requests are freed and Stop arrives. Answers Served."""

    request_ids: list[str]


class Stop(Command):
    """Ends a Serve (sent once the decode ranks answered); not answered."""


class OpenConsumer(Command):
    """A Consumer in ``mode`` over this rank's cache, handshaked with the producer at ``address``."""

    mode: PlanMode
    address: str
    producer_descriptors: list[RankDescriptor]
    timeout_s: float
    read_transport: str = "nixl"  # EngineConfig.read_transport of the consumer (bench Variant.read_transport)


class CloseConsumer(Command):
    """Close the open Consumer, if any."""


class RunEngine(Command):
    """A decode rank's timed window through the engine, from ``start_at`` (monotonic). Answers Ran."""

    items: list[EngineItem]
    concurrency: int
    start_at: float
    per_step: int = 1  # requests started together in one Consumer.start_reads call at most


class PlanTimes(Command):
    """Plan each request again, timed one by one. Answers Planned."""

    local_ids: list[tuple[tuple[int, ...], ...]]
    remote_ids: list[tuple[tuple[int, ...], ...]]
    num_tokens: int
    mode: PlanMode


class Poison(Command):
    """Decode cache and ceiling buffer back to the poison byte."""


class Verify(Command):
    """Every byte of the decode cache against the oracle of these requests."""

    layouts: list[RequestLayout]
    seeds: list[int]


class CeilingOpen(Command):
    """This rank's ceiling agent and buffer; a prefill rank fills it and answers CeilingBuffer."""

    slots: int
    slot_bytes: int
    seed: int


class CeilingAddSources(Command):
    """The prefill ranks this decode rank's ceiling reads from."""

    sources: list[CeilingSource]


class RunCeiling(Command):
    """A decode rank's ceiling window: per request one single-descriptor READ per source. Answers Ran."""

    request_ids: list[str]
    lengths: dict[int, int]  # source rank -> bytes per request
    concurrency: int
    start_at: float
    per_step: int = 1  # posts per round at most (a step, as RunEngine's)


class CeilingVerify(Command):
    """The first ``slots_used`` ceiling slots hold their sources' patterns."""

    slots_used: int
    lengths: dict[int, int]


class CopySourceSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One source of the physical-limit copy: its bytes per request, its GPU (cuda) and its pattern's seed."""

    rank: int
    nbytes: int
    gpu: int
    seed: int


class CopyOpen(Command):
    """A decode rank's physical-limit buffers, one per source (bench/ceiling.py CopySource)."""

    sources: list[CopySourceSpec]


class RunCopy(Command):
    """A decode rank's physical-limit window: per request one torch copy per source. Answers Ran."""

    request_ids: list[str]
    lengths: dict[int, int]
    concurrency: int
    start_at: float
    per_step: int = 1  # posts per round at most (a step, as RunEngine's)


class CopyVerify(Command):
    """The first ``slots_used`` slots hold the copies of their sources' buffers."""

    slots_used: int
    lengths: dict[int, int]


class Shutdown(Command):
    """Close everything and exit the command loop; not answered."""


AnyCommand = Union[  # noqa: UP007 - msgspec needs the union as an object at runtime
    Setup, SetEngineAddresses, Fill, Hold, Serve, Stop, OpenConsumer, CloseConsumer, RunEngine, PlanTimes,
    Poison, Verify, CeilingOpen, CeilingAddSources, RunCeiling, CeilingVerify, CopyOpen, RunCopy, CopyVerify,
    Shutdown,
]


# ---- replies (rank process -> coordinator) --------------------------------------------------
class Reply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="reply", tag=True):
    """Base of every reply; the tag is the class name."""


class Done(Reply):
    """The command ran and has nothing to return."""


class Failed(Reply):
    """The command raised: the exception's type name and message."""

    error_type: str
    message: str


class Started(Reply):
    """A prefill rank's Producer: its side-channel address and its cache descriptor."""

    address: str
    descriptor: RankDescriptor


class Held(Reply):
    """Encoded tickets and each hold() call's seconds, in request order."""

    tickets: list[bytes]
    hold_s: list[float]


class CeilingBuffer(Reply):
    """A prefill rank's ceiling buffer: its agent metadata, base address and device."""

    metadata: bytes
    base: int
    device_id: int


class Ran(Reply):
    """A decode rank's timed window."""

    run: ConsumerRun


class Served(Reply):
    """A prefill rank's timed window."""

    serve: ProducerServe


class Planned(Reply):
    """A decode rank's planning times."""

    timing: PlanTiming


AnyReply = Union[Done, Failed, Started, Held, CeilingBuffer, Ran, Served, Planned]  # noqa: UP007

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(AnyCommand)
_reply_decoder = msgspec.msgpack.Decoder(AnyReply)

R = TypeVar("R", bound=Reply)


def encode(message: Command | Reply) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes) -> Command:
    """A command from its bytes (msgspec.ValidationError / DecodeError names what is wrong)."""
    return _command_decoder.decode(data)


def decode_reply(data: bytes, expected: type[R], where: str) -> R:
    """The reply of type ``expected``; BenchError for a Failed reply, a different reply or undecodable bytes."""
    try:
        reply = _reply_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise BenchError(f"undecodable reply: {exc}", where=where) from exc
    if isinstance(reply, Failed):
        raise BenchError(f"{reply.error_type}: {reply.message}", where=where, remote_type=reply.error_type)
    if not isinstance(reply, expected):
        raise BenchError(f"expected a {expected.__name__} reply, got {type(reply).__name__}", where=where)
    return reply
