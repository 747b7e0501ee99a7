"""Wire messages: round trips, and hostile bytes that must raise our typed error (never anything else)."""

from __future__ import annotations

import msgspec
import pytest
from harness import TINY
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_checks import assert_every_truncation_refused, decode_bit_flipped

from hybrid_transfer.engine import wire
from hybrid_transfer.errors import WireDecodeError
from hybrid_transfer.layout import RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.plan.rank import describe_rank

GEOMETRY = RankGeometry(model_from_config(TINY, name="tiny"), 2, 1)
FINGERPRINT = fingerprint_of(GEOMETRY)
DIGEST = FINGERPRINT.digest()
RANK = describe_rank(GEOMETRY, [4096, 1 << 20], 8)
TICKET = wire.Ticket(engine_id="prefill-0", incarnation=7, addresses=("tcp://127.0.0.1:5000", "tcp://127.0.0.1:5001"),
                     tp_size=2, request_id="r-1", nonce=(1 << 63) - 1, block_ids=((1, 2), (3,), (4,), (5,)),
                     num_tokens=20, state_position=20, lease_s=30.0)
BODIES = [
    wire.HandshakeRequest(fingerprint=FINGERPRINT, rank=RANK, agent_name="decode-c0", engine_id="decode"),
    wire.HandshakeReply(accepted=True, engine_id="prefill-0", incarnation=7, engine_addresses=TICKET.addresses,
                        agent_name="prefill-p1", agent_metadata=b"\x00meta\xff", rank=RANK),
    wire.HandshakeReply(accepted=False, error="differ", differences=(
        wire.FieldDifference("conv_layout", "SD", "DS"), wire.FieldDifference("head_dim", 8, 16))),
    wire.Completion(request_id="r-1", nonce=5, consumer_rank=3, expected_consumers=2),
    wire.ErrorReply(reason="garbage"),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_every_body_round_trips_through_its_envelope(body):
    env, back = wire.decode(wire.encode(body, DIGEST))
    assert back == body
    assert env.version == wire.PROTOCOL_VERSION and env.fingerprint == DIGEST


def test_ticket_round_trips():
    assert wire.decode_ticket(wire.encode_ticket(TICKET)) == TICKET


def test_a_body_of_another_kind_is_refused():
    data = wire.encode(BODIES[3], DIGEST)
    with pytest.raises(WireDecodeError, match="expected a HANDSHAKE_REQUEST"):
        wire.decode(data, wire.Kind.HANDSHAKE_REQUEST)


def test_another_protocol_version_is_refused_after_the_envelope_only():
    env = wire.Envelope(wire.PROTOCOL_VERSION + 1, DIGEST, wire.Kind.COMPLETION, b"\xc1 not msgpack")
    with pytest.raises(WireDecodeError) as info:
        wire.decode_envelope(msgspec.msgpack.encode(env))
    assert info.value.version == wire.PROTOCOL_VERSION + 1
    old = msgspec.msgpack.encode(msgspec.structs.replace(TICKET, version=0))
    with pytest.raises(WireDecodeError, match="protocol version 0"):
        wire.decode_ticket(old)


def test_unknown_kind_tag_and_field_are_refused():
    unknown_kind = msgspec.msgpack.encode([wire.PROTOCOL_VERSION, DIGEST, 99, b""])
    with pytest.raises(WireDecodeError):
        wire.decode_envelope(unknown_kind)
    completion = msgspec.to_builtins(BODIES[3])
    for bad in ({**completion, "type": "nonsense"}, {**completion, "extra": 1}, {**completion, "nonce": "x"}):
        env = wire.Envelope(wire.PROTOCOL_VERSION, DIGEST, wire.Kind.COMPLETION, msgspec.msgpack.encode(bad))
        with pytest.raises(WireDecodeError):
            wire.decode(msgspec.msgpack.encode(env))


@pytest.mark.parametrize("body", BODIES + [TICKET], ids=lambda b: type(b).__name__)
def test_every_truncation_is_a_typed_error(body):
    data = wire.encode_ticket(body) if isinstance(body, wire.Ticket) else wire.encode(body, DIGEST)
    assert_every_truncation_refused(data, wire.decode_ticket if isinstance(body, wire.Ticket) else wire.decode)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_anything_but_our_error(data):
    for decode in (wire.decode, wire.decode_ticket):
        try:
            decode(data)
        except WireDecodeError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_bit_flips_of_a_valid_message_decode_or_raise_our_error(data):
    decode_bit_flipped(data, BODIES[1], DIGEST)


def test_oversized_and_non_bytes_input_are_refused():
    with pytest.raises(WireDecodeError, match="exceeds"):
        wire.decode_envelope(b"\x00" * (wire.MAX_MESSAGE_BYTES + 1))
    with pytest.raises(WireDecodeError, match="expected bytes"):
        wire.decode_envelope("text")  # type: ignore[arg-type]
