"""The handshake's two tiers, both sides, without sockets or NIXL."""

from __future__ import annotations

import pytest
from harness import TINY

from hybrid_transfer.engine import handshake, wire
from hybrid_transfer.engine.handshake import ListenerStats, ProducerCard
from hybrid_transfer.errors import HandshakeError
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    DType,
    KVLayout,
    RankGeometry,
    fingerprint_of,
    model_from_config,
)
from hybrid_transfer.plan.rank import describe_rank

MODEL = model_from_config(TINY, name="tiny")
ADDRESS = "tcp://127.0.0.1:1"


def _card(tp_size: int = 1, options: CacheOptions | None = None) -> ProducerCard:
    g = RankGeometry(MODEL, tp_size, 0, options)
    return ProducerCard(MODEL, fingerprint_of(g), describe_rank(g, [1 << 20, 1 << 24], 8), "prefill-p0",
                        b"metadata", "prefill", 11, (ADDRESS,) * tp_size)


def _request(geometry: RankGeometry, *, rank=None) -> bytes:
    rank = rank or describe_rank(geometry, [1 << 28, 1 << 30], 16)
    return handshake.make_request(fingerprint_of(geometry), rank, "decode-c0", "decode")


def _exchange(card: ProducerCard, consumer: RankGeometry, **kw):
    stats, accepted = ListenerStats(), []
    data = handshake.answer(card, _request(consumer, **kw), stats, accepted.append)
    return data, stats, accepted


def _refusal(card: ProducerCard, consumer: RankGeometry) -> HandshakeError:
    data, stats, accepted = _exchange(card, consumer)
    assert stats.rejected == 1 and accepted == [] and stats.causes == {"incompatible": 1}
    _, reply = wire.decode(data)
    assert reply.cause == "incompatible" and reply.error.startswith("refused (incompatible): ")  # issue 19
    with pytest.raises(HandshakeError) as info:
        handshake.read_reply(data, address=ADDRESS, digest=fingerprint_of(consumer).digest())
    assert info.value.cause == "incompatible"
    return info.value


def test_an_equal_consumer_is_accepted_and_gets_the_precomputed_reply():
    card = _card()
    data, stats, accepted = _exchange(card, RankGeometry(MODEL, 1, 0))
    assert data == card.accepted_reply and stats.accepted == 1 and accepted == ["decode-c0"]
    reply = handshake.read_reply(data, address=ADDRESS, digest=card.digest)
    assert reply.agent_metadata == b"metadata" and reply.rank == card.rank and reply.incarnation == 11


@pytest.mark.parametrize(("tp_size", "options"), [
    (2, None), (4, None), (1, CacheOptions(block_size=64, kernel_block_size=16)), (2, CacheOptions(block_size=32)),
])
def test_other_tp_and_block_sizes_only_need_to_be_compatible(tp_size, options):
    _, stats, accepted = _exchange(_card(), RankGeometry(MODEL, tp_size, tp_size - 1, options))
    assert stats.accepted == 1 and accepted == ["decode-c0"]


def _modified(**changes) -> dict:
    return {**TINY, **changes}


# One case per class of equal-tier field: a layout, a dtype, a model dimension, the layer-to-tensor map.
MISMATCHES = {
    "conv layout": (MODEL, CacheOptions(conv_layout=ConvLayout.SD), "conv_layout", "SD", "DS"),
    "kv layout": (MODEL, CacheOptions(kv_layout=KVLayout.SPLIT), "kv_layout", "split", "interleaved"),
    "dtype": (MODEL, CacheOptions(ssm_dtype=DType.BF16), "ssm_dtype", "bfloat16", "float32"),
    "model dimension": (model_from_config(_modified(head_dim=16)), None, "head_dim", 16, 8),
    "layer map": (model_from_config(_modified(layer_types=["full_attention"] * 2 + ["linear_attention"] * 6)),
                  None, "layer_tensor", [0, 1, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 1, 1]),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_an_equal_tier_mismatch_names_the_field_and_both_values(case):
    model, options, field, consumer_value, producer_value = MISMATCHES[case]
    error = _refusal(_card(), RankGeometry(model, 1, 0, options))
    found = {name: (c, p) for name, c, p in error.differences}
    assert field in found
    assert [_plain(v) for v in found[field]] == [consumer_value, producer_value]
    assert field in str(error) and repr(consumer_value) in str(error) and repr(producer_value) in str(error)


@pytest.mark.parametrize(("consumer", "producer"), [(KVLayout.SPLIT, KVLayout.INTERLEAVED),
                                                    (KVLayout.INTERLEAVED, KVLayout.SPLIT)])
def test_split_and_interleaved_sides_are_refused_naming_kv_layout(consumer, producer):
    """Equal block sizes and page sizes: without kv_layout in the fingerprint the two would shake hands."""
    card = _card(options=CacheOptions(kv_layout=producer))
    error = _refusal(card, RankGeometry(MODEL, 2, 1, CacheOptions(kv_layout=consumer)))
    assert [(n, c, p) for n, c, p in error.differences] == [("kv_layout", consumer.value, producer.value)]
    assert "kv_layout" in str(error)


def _plain(value):
    return list(value) if isinstance(value, (tuple, list)) else value


def test_every_differing_field_is_listed_not_just_the_first():
    error = _refusal(_card(), RankGeometry(model_from_config(_modified(head_dim=16)), 1, 0,
                                           CacheOptions(conv_layout=ConvLayout.SD, kv_dtype=DType.FP16)))
    assert {name for name, _, _ in error.differences} == {"head_dim", "kv_dtype", "conv_layout"}


def test_tp_sizes_that_do_not_divide_are_refused_by_the_producer():
    six = model_from_config(_modified(num_key_value_heads=6, linear_num_key_heads=6, linear_num_value_heads=12))
    g2 = RankGeometry(six, 2, 0)
    card = ProducerCard(six, fingerprint_of(g2), describe_rank(g2, [1 << 20, 1 << 24], 8), "p", b"m", "e", 1,
                        (ADDRESS, ADDRESS))
    error = _refusal(card, RankGeometry(six, 3, 1))
    assert "one TP size must divide the other" in str(error) and error.differences == ()


def test_a_forged_descriptor_is_refused():
    g = RankGeometry(MODEL, 1, 0)
    forged = describe_rank(g, [1 << 28, 1 << 30], 16)
    forged = type(forged)(**{**{f: getattr(forged, f) for f in forged.__struct_fields__}, "page_bytes": 999})
    data, stats, _ = _exchange(_card(), g, rank=forged)
    assert stats.rejected == 1
    with pytest.raises(HandshakeError, match="page_bytes"):
        handshake.read_reply(data, address=ADDRESS, digest=fingerprint_of(g).digest())


@pytest.mark.parametrize("data", [b"", b"garbage", b"\x93\x01\xa0", None])
def test_undecodable_requests_get_a_typed_error_reply(data):
    card = _card()
    if data is None:  # a well-formed message of the wrong kind
        data = wire.encode(wire.Completion(request_id="r", nonce=1, consumer_rank=0, expected_consumers=1),
                           card.digest)
    stats, accepted = ListenerStats(), []
    reply = handshake.answer(card, data, stats, accepted.append)
    env, body = wire.decode(reply)
    assert isinstance(body, wire.ErrorReply) and stats.garbage == 1 and accepted == []
    with pytest.raises(HandshakeError, match="could not read our request"):
        handshake.read_reply(reply, address=ADDRESS, digest=card.digest)


def test_the_consumer_refuses_bad_replies():
    card = _card()
    with pytest.raises(HandshakeError, match="undecodable reply"):
        handshake.read_reply(b"\xff\x00", address=ADDRESS, digest=card.digest)
    with pytest.raises(HandshakeError, match="inconsistent"):
        handshake.read_reply(card.accepted_reply, address=ADDRESS, digest="0" * 16)
    request = _request(RankGeometry(MODEL, 1, 0))
    with pytest.raises(HandshakeError, match="expected a handshake reply") as info:
        handshake.read_reply(request, address=ADDRESS, digest=card.digest)
    assert info.value.cause == "protocol"
