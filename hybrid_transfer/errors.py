"""Typed errors. Every failure the library raises derives from HybridTransferError.

Each subclass keeps the offending values as attributes so callers (and tests)
can act on them without parsing messages.

Messages are bounded (issue 19, docs/limits.md#error-messages): a value a message echoes is shown
through ``echo``, cut at ECHO_CHARS characters, and a whole message at MESSAGE_CHARS, so a hostile
10 MB field never becomes a 10 MB message or log line. The attributes keep the values whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ECHO_CHARS = 200  # the most characters of one echoed value in an error message
MESSAGE_CHARS = 8 * ECHO_CHARS  # the most characters of a whole message (a few echoed values and the text)


def echo(value: object) -> str:
    """``repr(value)`` cut at ECHO_CHARS characters, saying how long it was (how many items, for a sized one)."""
    try:
        text = repr(value)
    except Exception as exc:  # noqa: BLE001 - a message must never fail on the value it describes
        return f"<unprintable {type(value).__name__}: {type(exc).__name__}>"
    if len(text) <= ECHO_CHARS:
        return text
    size = f"{len(value)} items" if isinstance(value, (list, tuple, dict, set, frozenset)) else f"{len(text)} chars"
    return f"{text[:ECHO_CHARS]}... ({size})"


def _bounded(message: str) -> str:
    if len(message) <= MESSAGE_CHARS:
        return message
    return f"{message[:MESSAGE_CHARS]}... (message cut, {len(message)} chars)"


class HybridTransferError(Exception):
    """Base class of every error this library raises on purpose; its message is bounded (``MESSAGE_CHARS``)."""

    def __init__(self, *args: object):
        if args and isinstance(args[0], str):
            args = (_bounded(args[0]), *args[1:])
        super().__init__(*args)


class ConfigError(HybridTransferError, ValueError):
    """A model config, preset or option is missing or invalid."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None):
        super().__init__(message)
        self.field = field
        self.value = value


class UnknownPresetError(ConfigError):
    """A preset name that the registry does not ship."""

    def __init__(self, name: str, known: Sequence[str]):
        super().__init__(
            f"unknown preset {echo(name)}; known presets: {', '.join(sorted(known))}",
            field="preset",
            value=name,
        )
        self.name = name
        self.known = tuple(sorted(known))


class ShardingError(ConfigError):
    """A TP size or rank that cannot shard the model's heads or channels."""


class UnsupportedError(HybridTransferError):
    """A feature the library knowingly refuses (docs/index.md#not-supported)."""


class CacheShapeError(HybridTransferError, ValueError):
    """A cache allocation or wrapped tensor does not match the geometry."""

    def __init__(self, message: str, *, expected: Any = None, actual: Any = None):
        super().__init__(message)
        self.expected = expected
        self.actual = actual


class FingerprintMismatch(HybridTransferError):
    """Two engines disagree on fields that must be equal (handshake tier one)."""

    def __init__(self, differences: Sequence[tuple[str, Any, Any]]):
        self.differences = tuple(differences)
        parts = [f"{name}: ours={echo(ours)} theirs={echo(theirs)}" for name, ours, theirs in differences]
        super().__init__("incompatible peer: " + "; ".join(parts))


class PlanError(HybridTransferError, ValueError):
    """A transfer request cannot be planned or fails validation."""

    def __init__(self, message: str, **values: Any):
        super().__init__(message)
        self.values = values
        for key, value in values.items():
            setattr(self, key, value)


# ---- planner validation (docs/planner.md#validation) ----------


class TopologyError(PlanError):
    """The two engines' TP sizes (or their fixed layout fields) cannot be mapped onto each other."""

    def __init__(self, message: str, *, prefill_tp: int, decode_tp: int, **values: Any):
        super().__init__(f"prefill TP {prefill_tp} -> decode TP {decode_tp}: {message}",
                         prefill_tp=prefill_tp, decode_tp=decode_tp, **values)


class GroupCountError(PlanError):
    """A request lists block ids for the wrong number of cache groups."""

    def __init__(self, *, side: str, expected: int, actual: int):
        super().__init__(f"{side} block ids list {actual} cache groups, the cache has {expected}",
                         side=side, expected=expected, actual=actual)


class BlockCountError(PlanError):
    """A group lists the wrong number of block ids for the request's token count."""

    def __init__(self, *, side: str, group: int, expected: int, actual: int, at_least: bool = False):
        need = f"at least {expected}" if at_least else f"exactly {expected}"
        super().__init__(f"{side} group {group} lists {actual} block ids, needs {need}",
                         side=side, group=group, expected=expected, actual=actual, at_least=at_least)


class BlockIdError(PlanError):
    """A block id outside [0, num_blocks) of its side."""

    def __init__(self, *, side: str, group: int, block_id: int, num_blocks: int):
        super().__init__(f"{side} group {group}: block id {block_id} is outside [0, {num_blocks})",
                         side=side, group=group, block_id=block_id, num_blocks=num_blocks)


class DuplicateBlockError(PlanError):
    """A block id listed twice, within one group or across groups (the same id is the same bytes)."""

    def __init__(self, *, side: str, block_id: int, groups: Sequence[int]):
        super().__init__(f"{side} block id {block_id} is listed more than once (groups {list(groups)})",
                         side=side, block_id=block_id, groups=tuple(groups))


class RangeError(PlanError):
    """A planned byte range that does not lie inside one registered region."""

    def __init__(self, *, side: str, addr: int, length: int):
        super().__init__(f"{side} range [{addr:#x}, {addr + length:#x}) ({length} B) is not inside a registered region",
                         side=side, addr=addr, length=length)


class OverlapError(PlanError):
    """Two destination ranges of one plan overlap: one would overwrite the other."""

    def __init__(self, *, first: tuple[int, int], second: tuple[int, int]):
        super().__init__(f"destination ranges overlap: [{first[0]:#x}, +{first[1]}) and [{second[0]:#x}, +{second[1]})",
                         first=first, second=second)


class ByteCountError(PlanError):
    """Local bytes, remote bytes and the bytes the request must move disagree."""

    def __init__(self, *, local_bytes: int, remote_bytes: int, expected_bytes: int):
        super().__init__(f"plan moves {local_bytes} B locally and {remote_bytes} B remotely, "
                         f"the request needs {expected_bytes} B",
                         local_bytes=local_bytes, remote_bytes=remote_bytes, expected_bytes=expected_bytes)


class VerificationError(HybridTransferError):
    """A destination cache does not hold the bytes a correct transfer leaves (hybrid_transfer.verify).

    ``location`` decodes the first bad byte: its block and whether it is an attention K/V byte
    (layer, global head, token), a conv byte, an ssm byte, page padding or a block the request does not hold.
    """

    def __init__(self, message: str, *, tensor_index: int, first_bad_offset: int, num_bad_bytes: int,
                 block_id: int, location: str, expected_byte: int, actual_byte: int):
        super().__init__(message)
        self.tensor_index = tensor_index
        self.first_bad_offset = first_bad_offset
        self.num_bad_bytes = num_bad_bytes
        self.block_id = block_id
        self.location = location
        self.expected_byte = expected_byte
        self.actual_byte = actual_byte


# ---- engine: NIXL, side channel, requests (docs/lifecycle.md) ----------------------------


class EngineError(HybridTransferError):
    """A NIXL call failed; ``operation`` names it and ``agent`` the local agent (the NIXL error is the cause)."""

    def __init__(self, message: str, *, operation: str, agent: str, peer: str | None = None):
        super().__init__(f"{operation} on agent {echo(agent)}" + (f" (peer {echo(peer)})" if peer else "") + f": {message}")
        self.operation = operation
        self.agent = agent
        self.peer = peer


class WireDecodeError(HybridTransferError, ValueError):
    """Bytes from a peer that are not a valid message of ours: garbage, truncated, unknown tag or version."""

    def __init__(self, message: str, *, kind: str | None = None, version: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.version = version


class HandshakeError(HybridTransferError):
    """A producer and a consumer cannot work together; nothing was transferred.

    ``differences`` lists (field, consumer value, producer value) for every equal-tier field that differs.
    ``cause``: one word a consumer can act on (docs/security.md#links): the producer's refusal cause
    ("secret", "capacity", "incompatible", "busy"), or the consumer's own ("timeout", "unreachable",
    ...); "" when not known.
    """

    def __init__(self, message: str, *, address: str | None = None,
                 differences: Sequence[tuple[str, Any, Any]] = (), engine_key: tuple[str, int] | None = None,
                 cause: str = ""):
        self.address = address
        self.differences = tuple(differences)
        self.engine_key = engine_key  # (engine_id, incarnation) of the refusing engine, when it said
        self.cause = cause
        parts = [f"{name}: consumer={echo(ours)} producer={echo(theirs)}" for name, ours, theirs in self.differences]
        where = f" (producer {address})" if address else ""
        super().__init__(f"handshake failed{where}: {message}" + (": " + "; ".join(parts) if parts else ""))


class HandshakeTimeout(HandshakeError):
    """A producer rank did not answer the handshake within ``timeout_s``."""

    def __init__(self, *, address: str, timeout_s: float):
        super().__init__(f"no reply within {timeout_s} s", address=address, cause="timeout")
        self.timeout_s = timeout_s


class TicketError(HybridTransferError, ValueError):
    """A ticket the consumer refuses before any byte moves."""

    def __init__(self, message: str, *, request_id: str, **values: Any):
        super().__init__(f"request {echo(request_id)}: {message}")
        self.request_id = request_id
        self.values = values
        for key, value in values.items():
            setattr(self, key, value)


class ProducerNotAllowedError(TicketError):
    """A ticket names a producer address that ``EngineConfig.allowed_producers`` does not list; nothing connected."""

    def __init__(self, *, request_id: str, address: str):
        super().__init__(f"producer address {address} is not in EngineConfig.allowed_producers: not connecting",
                         request_id=request_id, address=address)


class StatePositionError(TicketError):
    """The ticket's recurrent-state position is not the one the caller expects (the N-1 contract)."""

    def __init__(self, *, request_id: str, expected: int, actual: int):
        super().__init__(f"ticket carries state position {actual}, the caller expects {expected}",
                         request_id=request_id, expected=expected, actual=actual)


class RequestStateError(HybridTransferError):
    """A request id used against its lifecycle: held or read twice, unknown, or an illegal state change."""

    def __init__(self, message: str, *, request_id: str, state: str | None = None):
        super().__init__(f"request {echo(request_id)}: {message}")
        self.request_id = request_id
        self.state = state


class ReadDeadlineError(HybridTransferError):
    """A consumer request did not finish within its deadline (``deadline_s``, in ``state``)."""

    def __init__(self, *, request_id: str, deadline_s: float, state: str):
        super().__init__(f"request {echo(request_id)} still {state} after its {deadline_s} s deadline")
        self.request_id = request_id
        self.deadline_s = deadline_s
        self.state = state


# ---- benchmark (hybrid_transfer.bench) ---------------------------------------------


class BenchError(HybridTransferError):
    """A benchmark run failed: a rank process raised or died, or a request did not end DONE.

    ``where`` names the rank process ("prefill 0", "decode 3") or the phase; ``remote_type`` is the
    type name of an exception raised inside a rank process.
    """

    def __init__(self, message: str, *, where: str | None = None, request_id: str | None = None,
                 remote_type: str | None = None):
        super().__init__((f"{where}: " if where else "") + message)
        self.where = where
        self.request_id = request_id
        self.remote_type = remote_type


# ---- request lifecycles under faults (issue 5) ---------------------------------------


class PeerDisconnectedError(EngineError):
    """NIXL reports the peer agent gone (its process died or closed): nothing more moves to or from it."""


class MappingError(EngineError):
    """A producer's mapping (engine/mapped/) could not be created, opened or used; ``peer`` names its agent."""

    def __init__(self, message: str, *, operation: str = "open mapping", agent: str = "", peer: str | None = None):
        super().__init__(message, operation=operation, agent=agent or "-", peer=peer)


class SourceLostError(HybridTransferError):
    """A producer rank a request depends on vanished (``agent``): its READ cannot finish."""

    def __init__(self, *, request_id: str, agent: str, detail: str = ""):
        super().__init__(f"request {echo(request_id)}: producer agent {echo(agent)} is gone" + (f" ({detail})" if detail else ""))
        self.request_id = request_id
        self.agent = agent
        self.detail = detail


class TicketRevokedError(HybridTransferError):
    """The producer aborted the request, or its lease expired, before this consumer finished reading it."""

    def __init__(self, *, request_id: str, nonce: int, agent: str | None = None):
        super().__init__(f"request {echo(request_id)}: the producer revoked its ticket"
                         + (f" (agent {echo(agent)})" if agent else ""))
        self.request_id = request_id
        self.nonce = nonce
        self.agent = agent


class TicketClaimError(HybridTransferError):
    """A producer rank refused this consumer rank's claim on a ticket (replayed, ended, revoked or edited).

    The request is FAILED: what its READs brought is never reported as the request's bytes.
    """

    def __init__(self, *, request_id: str, nonce: int, status: str, agent: str):
        super().__init__(f"request {echo(request_id)}: the producer agent {echo(agent)} refused the claim: {status}")
        self.request_id = request_id
        self.nonce = nonce
        self.status = status
        self.agent = agent


class RequestAbortedError(HybridTransferError):
    """The embedder aborted the request on this side (``state``: where it was when aborted)."""

    def __init__(self, *, request_id: str, state: str):
        super().__init__(f"request {echo(request_id)} aborted while {state}")
        self.request_id = request_id
        self.state = state


class FenceError(HybridTransferError, ValueError):
    """Blocks handed over while an engine step that writes them has not finished (step fences)."""

    def __init__(self, message: str, *, block_ids: Sequence[int], steps: Sequence[int], finished_step: int):
        super().__init__(f"{message}: blocks {echo(list(block_ids))} wait for steps {echo(list(steps))}, "
                         f"finished up to {finished_step}")
        self.block_ids = tuple(block_ids)
        self.steps = tuple(steps)
        self.finished_step = finished_step


class HoldCapacityError(HybridTransferError):
    """A producer rank refused a hold: it would pin more blocks than ``EngineConfig.max_held_blocks``.

    ``held``: blocks pinned now; ``asked``: blocks the hold would add (those not pinned already); ``cap``: the
    limit. Raised before anything is pinned (docs/limits.md).
    """

    def __init__(self, *, request_id: str, held: int, asked: int, cap: int):
        super().__init__(f"request {echo(request_id)}: holding it would pin {asked} more blocks on top of the {held} "
                         f"held, above max_held_blocks={cap}; nothing was pinned")
        self.request_id = request_id
        self.held = held
        self.asked = asked
        self.cap = cap


class BlockBusyError(HybridTransferError, ValueError):
    """Local blocks still owned by another request (reading, or quarantined until nothing can write them)."""

    def __init__(self, *, request_id: str, block_ids: Sequence[int], owners: Sequence[str]):
        super().__init__(f"request {echo(request_id)}: local blocks {echo(list(block_ids))} still belong to "
                         f"{echo(sorted(set(owners)))}")
        self.request_id = request_id
        self.block_ids = tuple(block_ids)
        self.owners = tuple(owners)


# ---- embedding in a serving engine: tickets issued by its scheduler (issue 12) ---------------


class EngineCardError(ConfigError):
    """The per-rank cards of one producer engine are incomplete or disagree (``ranks``: the ranks involved)."""

    def __init__(self, message: str, *, field: str | None = None, value: Any = None, ranks: Sequence[int] = ()):
        super().__init__(message, field=field, value=value)
        self.ranks = tuple(ranks)


class TicketMismatchError(TicketError):
    """A producer rank's own view disagrees with the ticket it is asked to honour; nothing was pinned.

    ``differences`` lists (field, this rank's value, the ticket's value) for every disagreement.
    """

    def __init__(self, *, request_id: str, differences: Sequence[tuple[str, Any, Any]]):
        diffs = tuple(differences)
        parts = "; ".join(f"{name}: rank={echo(ours)} ticket={echo(theirs)}" for name, ours, theirs in diffs)
        super().__init__(f"ticket disagrees with this producer rank: {parts}", request_id=request_id,
                         differences=diffs)


class TicketParamsError(WireDecodeError):
    """A ticket's JSON form (``kv_transfer_params``) with a missing, unknown or wrongly typed ``field``."""

    def __init__(self, message: str, *, field: str, value: Any = None):
        super().__init__(f"ticket params field {echo(field)}: {message}", kind="ticket")
        self.field = field
        self.value = value


class EngineSpecMismatch(ConfigError):
    """A serving engine's live cache disagrees with the model registry (layout/engine_spec.py).

    ``differences`` lists (field, the engine's value, the registry's value) for every disagreement;
    ``fields`` their names.
    """

    def __init__(self, differences: Sequence[tuple[str, Any, Any]]):
        self.differences = tuple(differences)
        parts = "; ".join(f"{name}: engine={echo(eng)} registry={echo(reg)}" for name, eng, reg in self.differences)
        super().__init__(f"the engine's cache disagrees with the model registry: {parts}",
                         field=self.differences[0][0] if self.differences else None)

    @property
    def fields(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.differences)
