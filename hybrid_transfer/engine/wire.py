"""Messages between engines: msgpack-encoded, frozen, tagged msgspec Structs; never pickle.

Every side-channel message and NIXL notification is an ``Envelope`` decoded in two
phases: first the envelope (protocol version, sender's fingerprint digest, kind),
checked before anything else, then its body with a typed Decoder built once.
The Envelope's own layout never changes; bodies evolve by adding fields with
defaults at the end and bumping PROTOCOL_VERSION.

Version log:
  1: Envelope; HandshakeRequest, HandshakeReply, Ticket, Completion, ErrorReply.
  2: lifecycle under faults (issue 5): CompletionKind ABORTED and FAILED; Heartbeat (lease
     renewal), Hello / Welcome (a consumer agent introduces itself over NIXL; the welcome lists
     revoked tickets), Revoke / RevokeAck (producer aborts and expiries), Bye (a consumer closes).
  2: pack mode (issue 6): StagingQuery / StagingReply, side channel only (defined at the end).
  3: attention KV layout (issue 11): RankDescriptor.kv_layout ("interleaved", vLLM 0.33's
     [heads][tokens][K|V], or "split" [K | V] halves), last and defaulted; the Fingerprint's
     kv_layout now carries it (it was the constant "HND"), so a split side and an interleaved
     side are refused at the handshake with kv_layout named in the diff.
  4: geometry from a live engine (issue 12): RankDescriptor.conv_dtype, last and defaulted ("": the
     model dtype), so a peer rebuilds a rank whose engine keeps conv state in another dtype. Tickets
     are unchanged; their JSON form (engine/ticket_params.py) is not a wire message.
  -: bounds (issue 14): length caps on names, ids and addresses, ranges on counts and nonces, checked
     at decode only (msgspec Meta); the bytes on the wire are unchanged, so no bump
     (docs/limits.md).
  5: authentication (issue 14, engine/auth.py): HandshakeRequest.client_nonce / server_nonce / proof,
     last and defaulted (empty without a secret); AuthChallenge (a producer with a secret answers a
     first request with its server nonce and proof, and sends agent metadata only after the
     consumer's proof); Sealed (with a secret, every NIXL notification is an inner envelope with a
     per-link counter and a MAC under the link key). Claim / ClaimReply (single-use tickets,
     engine/claims.py): DONE only after the producer confirmed the claim. Ticket.mac, last and defaulted
     (b"": unsigned), over the fields that decide the bytes (claims.sign); ticket_params carries it.
  6: pack mode's ready notification (issue 13): a producer rank tells its consumer agents where it
     staged a request once the gather is done (Staged, a NIXL notification: READY with address, bytes
     and gather time, or ABSENT), so a consumer posts its READ when that arrives, with no query round
     trip; Welcome.stages, last and defaulted (False), says whether the rank stages at all. The side
     channel's StagingQuery / StagingReply (kinds 20 and 21, issue 6) are gone; their numbers stay unused.
  7: the production shape (issue 19): HandshakeReply.cause, last and defaulted (""), names why a
     producer refused in one word a consumer can act on ("secret", "capacity", "incompatible", "busy"),
     so a refused link stores that cause and a later ticket fails naming it (docs/security.md).
  8: reads batched per step (issue 20, engine/read_batch.py): Claims (one per consumer agent, producer
     agent and step: each request's nonce and digest), ClaimReplies (one verdict per request) and
     Completions (one per producer agent per poll: request, nonce, expected consumers, kind), new kinds
     15-17, each list at most MAX_BATCH entries. The single Claim, ClaimReply and Completion stay
     (``read_batching="per_request"`` and claims kept for a later hold are answered one by one).
  9: page interiors (issue 26): RankDescriptor.kv_interior and Fingerprint.kv_interior, last and
     defaulted ("token-major"): the attention kernel's order inside a kernel page. A kernel page of an
     interior that is not token-major moves whole, and a pair whose interiors differ is refused at the
     handshake (docs/attention-layouts.md#page-interiors).
  11: the mapped read path (issue 28, engine/mapped/): HandshakeRequest.map_host / map_kinds (the host
     key and the mapping kinds a consumer can open) and HandshakeReply.mapping (a MapOffer: the kind and
     one handle per registered region), each last and defaulted. A producer sends a MapOffer only in the
     accepted reply of an authenticated handshake (a secret set on both sides) to a consumer on its host
     that can open that kind (docs/wire.md#v11, docs/security.md#mapped-reads). Version 10 is
     issue 27's.

NIXL notifications carry everything after the handshake, both ways: they reach exactly the agent
that serves or issues the READs, are reliable and ordered per connection, need no further socket,
and are taken in by the owner thread's poll() that already drains them; the side channel's
listener thread must stay a pure responder (side_channel.py).
"""

from __future__ import annotations

import enum
import re
from typing import Annotated, Any

import msgspec

from hybrid_transfer.errors import WireDecodeError, echo
from hybrid_transfer.layout.fingerprint import Fingerprint
from hybrid_transfer.plan.rank import RankDescriptor

PROTOCOL_VERSION = 11
MAX_MESSAGE_BYTES = 16 << 20  # agent metadata is a few KiB; anything near this is hostile

# Caps checked while decoding (issue 14): they bound what one peer message can make us store (a name
# is kept per accepted handshake) and leave the encoding unchanged, so they need no version bump.
# Our own names are under 64 characters; vLLM request ids under 100.
MAX_NAME_CHARS = 256  # agent names, engine ids, field names
MAX_ADDRESS_CHARS = 256  # side-channel addresses ("tcp://host:port")
MAX_REQUEST_ID_CHARS = 1024
MAX_TEXT_CHARS = 16 << 10  # error messages
MAX_NONCE = (1 << 63) - 1  # nonces and incarnations are non-negative int64 on every side

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Address = Annotated[str, msgspec.Meta(max_length=MAX_ADDRESS_CHARS)]
RequestId = Annotated[str, msgspec.Meta(max_length=MAX_REQUEST_ID_CHARS)]
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]
Nonce = Annotated[int, msgspec.Meta(ge=0, le=MAX_NONCE)]
Count = Annotated[int, msgspec.Meta(ge=0)]  # token counts, block ids, ranks, byte counts
Seconds = Annotated[float, msgspec.Meta(ge=0)]
MAX_AUTH_BYTES = 64  # nonces and MACs (32 bytes each today)
AuthBytes = Annotated[bytes, msgspec.Meta(max_length=MAX_AUTH_BYTES)]
MAX_MAP_REGIONS = 4096  # regions of one MapOffer (version 11): a rank registers one per shared tensor (tens)
MAX_MAP_HANDLE_BYTES = 1024  # one region's handle (a shared-memory name, or a CUDA IPC handle and its fields)
MAP_KINDS = ("shm", "cuda_ipc")  # version 11: what a MapOffer's handles open (engine/mapped/)
MAX_BATCH = 1024  # entries of one Claims / ClaimReplies / Completions (version 8); a sender splits longer lists


class Kind(enum.IntEnum):
    HANDSHAKE_REQUEST = 1
    HANDSHAKE_REPLY = 2
    COMPLETION = 3
    ERROR = 4
    HEARTBEAT = 5
    HELLO = 6
    WELCOME = 7
    REVOKE = 8
    REVOKE_ACK = 9
    BYE = 10
    AUTH_CHALLENGE = 11
    SEALED = 12
    CLAIM = 13
    CLAIM_REPLY = 14
    CLAIMS = 15  # version 8: batched per step (engine/read_batch.py)
    CLAIM_REPLIES = 16
    COMPLETIONS = 17
    # Pack mode, numbered apart so other additions never collide; 20 and 21 were issue 6's side-channel
    # StagingQuery / StagingReply (gone in version 6) and stay unused.
    STAGED = 22


class Envelope(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """Outer frame of every message; its layout is fixed forever (only the body evolves)."""

    version: int
    fingerprint: str  # sender's Fingerprint.digest(); "" when unknown (an error reply to garbage)
    kind: Kind
    body: bytes


class HandshakeRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="handshake_request"):
    """A consumer rank introduces itself to one producer rank."""

    fingerprint: Fingerprint
    rank: RankDescriptor
    agent_name: Name
    engine_id: Name
    client_nonce: AuthBytes = b""  # with a secret: fresh per handshake (engine/auth.py)
    server_nonce: AuthBytes = b""  # the second request only: the producer's challenge
    proof: AuthBytes = b""  # ... and the consumer's proof of the secret over both nonces
    map_host: Name = ""  # version 11: this host's key (engine/mapped/host.py); "": the consumer maps nothing
    map_kinds: Annotated[tuple[Name, ...], msgspec.Meta(max_length=8)] = ()  # ... the MAP_KINDS it can open


class AuthChallenge(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="auth_challenge"):
    """A producer with a secret answers a first handshake request: prove the secret (engine/auth.py)."""

    server_nonce: AuthBytes
    proof: AuthBytes  # the producer's proof of the secret over both nonces and both agent names
    agent_name: Name  # the producer agent the proof (and so the link key) binds


class Sealed(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A notification between authenticated agents: ``message`` is the inner encoded envelope."""

    counter: Nonce  # strictly increasing per link and direction
    mac: AuthBytes
    message: bytes


class ClaimStatus(enum.IntEnum):
    """A producer rank's answer to a claim; only CONFIRMED lets the consumer report DONE."""

    CONFIRMED = 1  # held with this nonce, the digest matches, and this consumer rank's first claim
    CLAIMED = 2  # this consumer rank already claimed this ticket: a replay
    ENDED = 3  # the request was freed, expired or aborted (or re-held with another nonce)
    REVOKED = 4  # the request is being aborted
    EDITED = 5  # the ticket's fields differ from what this rank holds


class Claim(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="claim"):
    """A consumer rank posted READs of a ticket (engine/claims.py): is it live and unclaimed?"""

    request_id: RequestId
    nonce: Nonce
    consumer_rank: Count
    digest: AuthBytes  # claims.ticket_digest of the ticket as the consumer read by it


class ClaimReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="claim_reply"):
    """The producer rank's verdict on one claim."""

    request: RequestRef
    consumer_rank: Count
    status: ClaimStatus


class ClaimEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One request of a batched claim (version 8): what a single Claim says, less the consumer rank."""

    request_id: RequestId
    nonce: Nonce
    digest: AuthBytes


class Claims(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="claims"):
    """Every request a consumer rank posted READs of to one producer agent in one step (version 8)."""

    consumer_rank: Count
    entries: Annotated[tuple[ClaimEntry, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class ClaimVerdict(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """The producer rank's answer on one request of a batched claim."""

    request: RequestRef
    status: ClaimStatus


class ClaimReplies(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="claim_replies"):
    """The producer rank's verdicts on one Claims message, one per request answered now (version 8)."""

    consumer_rank: Count
    verdicts: Annotated[tuple[ClaimVerdict, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class FieldDifference(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One equal-tier field that differs, with both values."""

    field: Name
    consumer: Any
    producer: Any


REFUSAL_CAUSES = ("secret", "capacity", "incompatible", "busy")  # HandshakeReply.cause (version 7)


class MapRegion(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One registered region as a mapping opens it (version 11): its address on the producer and its handle."""

    addr: Count  # the region's base address in the producer (the RankDescriptor's tensor address)
    length: Count
    handle: Annotated[bytes, msgspec.Meta(max_length=MAX_MAP_HANDLE_BYTES)]


class MapOffer(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a consumer on the producer's host needs to map the producer's cache (version 11).

    A handle grants what a NIXL remote key grants (docs/security.md#mapped-reads): it travels only inside an
    accepted, authenticated handshake reply.
    """

    kind: Name  # one of MAP_KINDS
    host: Name  # the producer's host key: the consumer maps only when it equals its own
    regions: Annotated[tuple[MapRegion, ...], msgspec.Meta(max_length=MAX_MAP_REGIONS)]


class HandshakeReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="handshake_reply"):
    """A producer rank's answer: its agent and cache, or why it refuses."""

    accepted: bool
    error: Text = ""
    differences: tuple[FieldDifference, ...] = ()
    engine_id: Name = ""
    incarnation: Nonce = 0
    engine_addresses: tuple[Address, ...] = ()  # side-channel address of every rank, index == tp_rank
    agent_name: Name = ""
    agent_metadata: bytes = b""
    rank: RankDescriptor | None = None
    cause: Name = ""  # version 7: why a refusal happened, one of REFUSAL_CAUSES; "" when accepted
    mapping: MapOffer | None = None  # version 11: handles of the rank's regions (authenticated, same host only)


class Ticket(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="ticket"):
    """What a producer hands a consumer (through the embedder) so it can read a request.

    Every rank of one producer engine issues the same ticket for a request (same nonce).
    ``lease_s`` is measured on the producer's clock; never compare it with another host's clock.
    """

    engine_id: Name
    incarnation: Nonce
    addresses: tuple[Address, ...]  # side-channel address of every producer rank, index == tp_rank
    tp_size: Annotated[int, msgspec.Meta(ge=1)]
    request_id: RequestId
    nonce: Nonce
    block_ids: tuple[tuple[Count, ...], ...]  # per cache group, tensor_map.groups order
    num_tokens: Count
    state_position: Count  # tokens folded into the recurrent state (== num_tokens under the N-1 rule)
    lease_s: Annotated[float, msgspec.Meta(gt=0)]
    version: int = PROTOCOL_VERSION
    mac: AuthBytes = b""  # engine/claims.py: HMAC of the fields under the engine's ticket key; b"": unsigned

    @property
    def engine_key(self) -> tuple[str, int]:
        return (self.engine_id, self.incarnation)


class CompletionKind(enum.IntEnum):
    """What a consumer rank is finished with; every kind counts towards the producer's free."""

    DONE = 1  # the consumer's READs from this rank (if any) are complete
    ABORTED = 2  # the consumer's embedder aborted the request (it may not have read at all)
    FAILED = 3  # the consumer's read failed; it will not read again (the embedder recomputes)


class Completion(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="completion"):
    """A consumer rank tells a producer rank it is finished with a request (docs/lifecycle.md#who-notifies-whom)."""

    request_id: RequestId
    nonce: Nonce
    consumer_rank: Count
    expected_consumers: int  # distinct consumer ranks this producer rank hears from for the request
    kind: CompletionKind = CompletionKind.DONE


class CompletionEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """One request of a batched completion (version 8): what a single Completion says, less the consumer rank."""

    request_id: RequestId
    nonce: Nonce
    expected_consumers: int
    kind: CompletionKind


class Completions(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="completions"):
    """Every request a consumer rank finished with one producer rank during one poll (version 8)."""

    consumer_rank: Count
    entries: Annotated[tuple[CompletionEntry, ...], msgspec.Meta(min_length=1, max_length=MAX_BATCH)]


class ErrorReply(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="error"):
    """Answer to a message the listener could not decode."""

    reason: Text


class RequestRef(msgspec.Struct, frozen=True, forbid_unknown_fields=True, array_like=True):
    """A request as issued by one ticket: its id and the ticket's nonce."""

    request_id: RequestId
    nonce: Nonce


class Heartbeat(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="heartbeat"):
    """A consumer rank still waits for or reads these requests: renew their leases (producer's clock)."""

    consumer_rank: Count
    requests: tuple[RequestRef, ...]


class Hello(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="hello"):
    """A consumer agent, after its handshake, introduces itself so the producer rank can notify it."""

    consumer_rank: Count
    agent_metadata: bytes


class Welcome(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="welcome"):
    """The producer rank's answer to a Hello: tickets it no longer honours. No READ before it arrives."""

    revoked: tuple[RequestRef, ...]
    lease_s: Seconds  # how long the consumer must remember them (no live ticket outlasts this)
    stages: bool = False  # pack mode (issue 13): this rank stages its requests and sends a Staged for each


class Revoke(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="revoke"):
    """The producer rank aborted a request (or its lease expired): never report it DONE; acknowledge."""

    request: RequestRef
    lease_s: Seconds  # how long the consumer must remember the revocation


class RevokeAck(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="revoke_ack"):
    """The consumer agent has taken in a Revoke: from now on it never reports that request DONE."""

    request: RequestRef


class Bye(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="bye"):
    """A consumer agent is closing: forget it (it reads nothing any more)."""

    consumer_rank: Count


Body = (HandshakeRequest | HandshakeReply | Completion | ErrorReply | Heartbeat | Hello | Welcome | Revoke
        | RevokeAck | Bye | AuthChallenge | Sealed | Claim | ClaimReply | Claims | ClaimReplies | Completions)
_BODY_OF_KIND = {
    Kind.HANDSHAKE_REQUEST: HandshakeRequest,
    Kind.HANDSHAKE_REPLY: HandshakeReply,
    Kind.COMPLETION: Completion,
    Kind.ERROR: ErrorReply,
    Kind.HEARTBEAT: Heartbeat,
    Kind.HELLO: Hello,
    Kind.WELCOME: Welcome,
    Kind.REVOKE: Revoke,
    Kind.REVOKE_ACK: RevokeAck,
    Kind.BYE: Bye,
    Kind.AUTH_CHALLENGE: AuthChallenge,
    Kind.SEALED: Sealed,
    Kind.CLAIM: Claim,
    Kind.CLAIM_REPLY: ClaimReply,
    Kind.CLAIMS: Claims,
    Kind.CLAIM_REPLIES: ClaimReplies,
    Kind.COMPLETIONS: Completions,
}
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE_DECODER = msgspec.msgpack.Decoder(Envelope)
_BODY_DECODERS = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _BODY_OF_KIND.items()}
_TICKET_DECODER = msgspec.msgpack.Decoder(Ticket)


_KIND_OF_BODY = {cls: kind for kind, cls in _BODY_OF_KIND.items()}


def encode(body: Body, fingerprint: str) -> bytes:
    """Wrap a body in an Envelope of the current protocol version."""
    kind = _KIND_OF_BODY.get(type(body)) or next(k for k, cls in _BODY_OF_KIND.items() if isinstance(body, cls))
    return _ENCODER.encode(Envelope(PROTOCOL_VERSION, fingerprint, kind, _ENCODER.encode(body)))


def decode_envelope(data: bytes) -> Envelope:
    """Phase one: the envelope only.

    Raises:
        WireDecodeError: not an envelope of ours, or of another protocol version.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireDecodeError(f"expected bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireDecodeError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        env = _ENVELOPE_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"not a hybrid_transfer envelope: {exc}") from exc
    if env.version != PROTOCOL_VERSION:
        raise WireDecodeError(f"protocol version {env.version}, this side speaks {PROTOCOL_VERSION}",
                              version=env.version, kind=env.kind.name)
    return env


def decode_body(env: Envelope, expected: Kind | None = None) -> Body:
    """Phase two: the body, with the typed decoder of the envelope's kind.

    Raises:
        WireDecodeError: a kind other than ``expected``, or a body that does not decode.
    """
    if expected is not None and env.kind is not expected:
        raise WireDecodeError(f"expected a {expected.name} message, got {env.kind.name}", kind=env.kind.name)
    try:
        return _BODY_DECODERS[env.kind].decode(env.body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireDecodeError(f"bad {env.kind.name} body: {exc}", kind=env.kind.name) from exc


def decode(data: bytes, expected: Kind | None = None) -> tuple[Envelope, Body]:
    """Both phases; the caller checks ``env.fingerprint`` where it matters."""
    env = decode_envelope(data)
    return env, decode_body(env, expected)


def encode_ticket(ticket: Ticket) -> bytes:
    return _ENCODER.encode(ticket)


def decode_ticket(data: bytes) -> Ticket:
    """A ticket from bytes (as handed over by the embedder).

    Raises:
        WireDecodeError: not a ticket, a field of the wrong type or out of range (named with its
            value), or of another protocol version.
    """
    try:
        ticket = _TICKET_DECODER.decode(data)
    except msgspec.ValidationError as exc:
        raise WireDecodeError(f"invalid ticket: {_named(data, exc)}", kind="ticket") from exc
    except (msgspec.DecodeError, TypeError) as exc:
        raise WireDecodeError(f"not a ticket: {exc}") from exc
    if ticket.version != PROTOCOL_VERSION:
        raise WireDecodeError(f"ticket of protocol version {ticket.version}, this side speaks {PROTOCOL_VERSION}",
                              version=ticket.version, kind="ticket")
    return ticket


_NOT_ENCODED = (TypeError, OverflowError, RecursionError, msgspec.EncodeError)  # RecursionError: lists nested deep


def check_ticket(ticket: object) -> Ticket:
    """An in-process ticket, checked exactly as one decoded from bytes (msgspec does not check at construction).

    Raises:
        WireDecodeError: not a Ticket, or a field that could not travel (named with its value).
    """
    if not isinstance(ticket, Ticket):
        raise WireDecodeError(f"expected a Ticket, got {type(ticket).__name__} (decode bytes with decode_ticket)",
                              kind="ticket")
    try:
        data = encode_ticket(ticket)
    except _NOT_ENCODED:
        for field in Ticket.__struct_fields__:
            value = getattr(ticket, field)
            try:
                _ENCODER.encode(value)
            except _NOT_ENCODED as exc:
                raise WireDecodeError(f"invalid ticket: {field}={_short(value)} cannot be encoded: {exc}",
                                      kind="ticket") from exc
        raise
    return decode_ticket(data)


_PATH_STEP = re.compile(r"\.([A-Za-z_]\w*)|\[(\d+)\]")


def _named(data: bytes, exc: msgspec.ValidationError) -> str:
    """msgspec's message led by the offending field and its value: 'num_tokens=-1: Expected `int` >= 0 ...'."""
    message = str(exc)
    head, sep, path = message.rpartition(" - at `$")
    if not sep:
        return message
    path = path.rstrip("`")
    try:
        value = msgspec.msgpack.decode(data)
        for key, index in _PATH_STEP.findall(path):
            value = value[key] if key else value[int(index)]
    except (msgspec.DecodeError, KeyError, IndexError, TypeError):
        return message
    return f"{path.lstrip('.')}={_short(value)}: {head}"


def _short(value: object) -> str:
    return echo(value)  # cut at errors.ECHO_CHARS, like every echoed value


# ---- pack mode: where a producer rank staged a request (engine/pack/stager.py) ------------------------
# A NIXL notification from the producer rank to each consumer agent it welcomed, sent when the
# gather is done (issue 13). The producer cannot know which consumer reads a request (a scheduler
# may issue the ticket before any gather has run), so it tells every welcomed agent, and a new one
# hears about every request still staged right after its Welcome. A consumer that posts before the
# notification arrives waits for it; no query crosses the side channel.
class StagingStatus(enum.IntEnum):
    READY = 1  # gathered: read ``nbytes`` at ``addr`` (the consumer's ranges lie inside)
    ABSENT = 3  # nothing staged (the pool was full): read directly


class Staged(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag="staged"):
    """A producer rank's ready notification: where (and whether) it staged a held request."""

    request_id: RequestId
    nonce: Nonce
    status: StagingStatus
    addr: Count = 0
    nbytes: Count = 0
    device_id: Count = 0
    gather_s: Seconds = 0.0  # the gather's own time, measured on the producer


_BODY_OF_KIND[Kind.STAGED] = Staged
_BODY_DECODERS[Kind.STAGED] = msgspec.msgpack.Decoder(Staged)
