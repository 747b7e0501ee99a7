"""Wire messages of the lifecycle (protocol version 2): round trips, and bytes that must raise our error."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_checks import assert_every_truncation_refused, decode_bit_flipped

from hybrid_transfer.engine import wire
from hybrid_transfer.errors import WireDecodeError

DIGEST = "0123456789abcdef"
REF = wire.RequestRef("r-1", (1 << 63) - 1)
BODIES = [
    wire.Completion(request_id="r-1", nonce=5, consumer_rank=0, expected_consumers=1, kind=wire.CompletionKind.ABORTED),
    wire.Completion(request_id="r-1", nonce=5, consumer_rank=1, expected_consumers=2, kind=wire.CompletionKind.FAILED),
    wire.Heartbeat(consumer_rank=3, requests=(REF, wire.RequestRef("r-2", 0))),
    wire.Heartbeat(consumer_rank=0, requests=()),
    wire.Hello(consumer_rank=1, agent_metadata=b"\x00meta\xff"),
    wire.Welcome(revoked=(REF,), lease_s=120.0),
    wire.Revoke(request=REF, lease_s=30.0),
    wire.RevokeAck(request=REF),
    wire.Bye(consumer_rank=2),
]


def test_the_lifecycle_bumped_the_protocol_version():
    assert wire.PROTOCOL_VERSION >= 2


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_every_lifecycle_body_round_trips(body):
    env, back = wire.decode(wire.encode(body, DIGEST))
    assert back == body and env.fingerprint == DIGEST


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_every_truncation_is_a_typed_error(body):
    assert_every_truncation_refused(wire.encode(body, DIGEST))


def test_a_body_under_another_kind_or_with_an_unknown_completion_kind_is_refused():
    env = wire.decode_envelope(wire.encode(BODIES[2], DIGEST))
    with pytest.raises(WireDecodeError):
        wire.decode_body(msgspec.structs.replace(env, kind=wire.Kind.REVOKE))
    bad = {**msgspec.to_builtins(BODIES[0]), "kind": 9}
    raw = msgspec.msgpack.encode(wire.Envelope(wire.PROTOCOL_VERSION, DIGEST, wire.Kind.COMPLETION,
                                               msgspec.msgpack.encode(bad)))
    with pytest.raises(WireDecodeError):
        wire.decode(raw)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_bit_flips_of_a_heartbeat_decode_or_raise_our_error(data):
    decode_bit_flipped(data, BODIES[2], DIGEST)
