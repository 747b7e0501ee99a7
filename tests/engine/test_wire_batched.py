"""Version 8's batched messages (engine/wire.py, engine/read_batch.py): round trips, strict decoding, bounds."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_checks import assert_round_trip_and_truncations, decode_bit_flipped

from hybrid_transfer.engine import wire
from hybrid_transfer.errors import WireDecodeError

DIGEST = "f" * 16
REF = wire.RequestRef("r", 5)
BATCHED = [
    wire.Claims(consumer_rank=1, entries=(wire.ClaimEntry("r", 5, b"d" * 32), wire.ClaimEntry("s", 6, b"e" * 32))),
    wire.ClaimReplies(consumer_rank=1, verdicts=(wire.ClaimVerdict(REF, wire.ClaimStatus.CONFIRMED),
                                                 wire.ClaimVerdict(wire.RequestRef("s", 6), wire.ClaimStatus.EDITED))),
    wire.Completions(consumer_rank=1, entries=(wire.CompletionEntry("r", 5, 2, wire.CompletionKind.DONE),
                                               wire.CompletionEntry("s", 6, 1, wire.CompletionKind.ABORTED))),
]


def test_the_protocol_is_version_11():
    # 8 batched reads per step; 9 added kv_interior (issue 26); 10 draft_layers and speculative_slots
    # (issue 27); 11 the mapped path (issue 28)
    assert wire.PROTOCOL_VERSION == 11
    assert (wire.Kind.CLAIMS, wire.Kind.CLAIM_REPLIES, wire.Kind.COMPLETIONS) == (15, 16, 17)


@pytest.mark.parametrize("body", BATCHED, ids=lambda b: type(b).__name__)
def test_batched_bodies_round_trip_and_every_truncation_is_our_error(body):
    assert_round_trip_and_truncations(body, DIGEST)


def _raw(kind: wire.Kind, fields: dict) -> bytes:
    body = msgspec.msgpack.encode(fields)
    return msgspec.msgpack.encode(wire.Envelope(wire.PROTOCOL_VERSION, DIGEST, kind, body))


@pytest.mark.parametrize("count", [0, wire.MAX_BATCH + 1])
def test_an_empty_or_overlong_batch_is_refused_at_decode(count):
    entries = [["r", i, b"d"] for i in range(count)]
    with pytest.raises(WireDecodeError, match="entries"):
        wire.decode(_raw(wire.Kind.CLAIMS, {"type": "claims", "consumer_rank": 0, "entries": entries}))
    entries = [["r", i, 1, 1] for i in range(count)]
    with pytest.raises(WireDecodeError, match="entries"):
        wire.decode(_raw(wire.Kind.COMPLETIONS, {"type": "completions", "consumer_rank": 0, "entries": entries}))
    verdicts = [[["r", i], 1] for i in range(count)]
    with pytest.raises(WireDecodeError, match="verdicts"):
        wire.decode(_raw(wire.Kind.CLAIM_REPLIES, {"type": "claim_replies", "consumer_rank": 0, "verdicts": verdicts}))


def test_a_full_batch_decodes():
    entries = [["r", i, 1, 3] for i in range(wire.MAX_BATCH)]
    _, body = wire.decode(_raw(wire.Kind.COMPLETIONS, {"type": "completions", "consumer_rank": 0, "entries": entries}))
    assert len(body.entries) == wire.MAX_BATCH and body.entries[-1].kind is wire.CompletionKind.FAILED


@pytest.mark.parametrize("fields", [
    {"type": "claims", "consumer_rank": 0, "entries": [["r", 1, b"d"]], "extra": 1},  # unknown field
    {"type": "claims", "consumer_rank": 0, "entries": [["r", -1, b"d"]]},  # nonce out of range
    {"type": "claims", "consumer_rank": 0, "entries": [["r", 1, b"d" * 65]]},  # digest too long
    {"type": "claims", "consumer_rank": 0, "entries": [["r", 1]]},  # an entry short of a field
])
def test_batched_decoding_is_strict(fields):
    with pytest.raises(WireDecodeError):
        wire.decode(_raw(wire.Kind.CLAIMS, fields))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzzed_batches_decode_or_raise_our_error(data):
    decode_bit_flipped(data, data.draw(st.sampled_from(BATCHED)), DIGEST)
