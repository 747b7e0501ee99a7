"""Authentication with a shared secret (issue 14, rows 1 and 3): handshakes, sealed notifications, rank binding.

Unit tests of engine/auth.py and the listener's challenge-response without sockets; a forged
handshake against a real producer's side channel; then real NIXL agents in separate processes
(harness workers) with the secret on: a read that moves and verifies bytes, while forged,
replayed, unsealed and rank-spoofing notifications under the real agents' names are dropped and
counted.
"""

from __future__ import annotations

import logging
import time

import msgspec
import pytest
import zmq
from auth_ops import record_sends, rejections, replay_sent, sealed_notify
from harness import TINY, RankSpec, hold_everywhere, raw_notify, start_consumers, start_producers
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_checks import assert_round_trip_and_truncations, decode_bit_flipped

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine import Consumer, EngineConfig, Producer, auth, handshake, wire
from hybrid_transfer.engine.handshake import ListenerAuth, ListenerStats, ProducerCard
from hybrid_transfer.engine.peer_record import PeerRecord
from hybrid_transfer.errors import ConfigError, HandshakeError, WireDecodeError
from hybrid_transfer.layout import CacheOptions, RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.plan.rank import describe_rank
from hybrid_transfer.verify import RequestLayout

MODEL = model_from_config(TINY, name="tiny")
GEOMETRY = RankGeometry(MODEL, 1, 0)
DIGEST = fingerprint_of(GEOMETRY).digest()
SECRET = b"s3cret-for-tests-0123456789abcdef"
WAIT_S = 20.0


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    return str(path)


# ---- engine/auth.py ----------------------------------------------------------------------------


def test_the_secret_comes_from_the_file_else_the_environment_and_is_never_in_an_error(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    assert auth.load_secret(None) is None
    monkeypatch.setenv(auth.SECRET_ENV, " env-secret-0123456789 ")
    assert auth.load_secret(None) == b"env-secret-0123456789"
    path = tmp_path / "s"
    path.write_bytes(SECRET)
    assert auth.load_secret(str(path)) == SECRET  # the file wins
    path.write_bytes(b"short-secret")
    with pytest.raises(ConfigError, match="16 to 4096 bytes") as info:
        auth.load_secret(str(path))
    assert "short-secret" not in str(info.value)
    with pytest.raises(ConfigError, match="cannot be read"):
        auth.load_secret(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="secret_file"):
        EngineConfig(secret_file="").validate()


def test_a_link_accepts_each_message_once_in_order_and_never_its_own_reflected():
    key = b"k" * 32
    consumer, producer = auth.Link.for_consumer(key), auth.Link.for_producer(key)
    first, second = consumer.seal(b"one"), consumer.seal(b"two")
    producer.check(*first, b"one")
    producer.check(*second, b"two")
    for counter, mac, inner, cause in ((*first, b"one", "replay"), (*second, b"two", "replay"),
                                       (first[0] + 5, first[1], b"one", "mac"), (*second, b"tw0", "mac")):
        with pytest.raises(auth.Rejected) as info:
            producer.check(counter, mac, inner)
        assert info.value.cause == cause
    reply = producer.seal(b"back")
    with pytest.raises(auth.Rejected, match="mac"):  # a producer's message sent back to it
        producer.check(*reply, b"back")
    consumer.check(*reply, b"back")
    with pytest.raises(auth.Rejected, match="mac"):  # another link's key
        auth.Link.for_producer(b"x" * 32).check(*consumer.seal(b"m"), b"m")


def test_challenges_store_nothing_before_the_proof_and_are_accepted_once_within_their_deadline():
    now = [0.0]
    table = auth.Challenges(lambda: now[0], deadline_s=10.0, capacity=2)
    sn = table.issue("a", b"n" * 32)
    assert len(sn) == auth.NONCE_BYTES and len(table) == 0  # issuing stores nothing
    for _ in range(5000):  # a flood of first requests: still nothing stored
        table.issue("flood", auth.new_nonce())
    assert len(table) == 0
    assert table.check("b", b"n" * 32, sn) is auth.Verdict.FORGED  # bound to the agent ...
    assert table.check("a", b"m" * 32, sn) is auth.Verdict.FORGED  # ... and to the client nonce
    assert table.check("a", b"n" * 32, sn[:-1] + bytes([sn[-1] ^ 1])) is auth.Verdict.FORGED
    assert table.check("a", b"n" * 32, b"short") is auth.Verdict.FORGED
    other = auth.Challenges(lambda: now[0], deadline_s=10.0, capacity=2)  # another process key
    assert other.check("a", b"n" * 32, sn) is auth.Verdict.FORGED
    assert table.take("a", b"n" * 32, sn) is auth.Verdict.FRESH
    assert table.take("a", b"n" * 32, sn) is auth.Verdict.REPLAYED and len(table) == 1
    # The record of accepted exchanges is bounded: full of live entries, a new proof is refused, never one forgotten.
    assert table.take("b", b"2" * 32, table.issue("b", b"2" * 32)) is auth.Verdict.FRESH
    third = table.issue("c", b"3" * 32)
    assert table.take("c", b"3" * 32, third) is auth.Verdict.FULL and table.num_full == 1
    late = table.issue("d", b"4" * 32)
    now[0] = 9.999
    assert table.check("d", b"4" * 32, late) is auth.Verdict.FRESH
    now[0] = 10.0
    assert table.check("d", b"4" * 32, late) is auth.Verdict.STALE
    # Past their deadlines the accepted entries are forgotten (a replay would be STALE anyway), making room.
    fresh = table.issue("c", b"3" * 32)
    assert table.take("c", b"3" * 32, fresh) is auth.Verdict.FRESH and len(table) == 1
    assert table.check("a", b"n" * 32, sn) is auth.Verdict.STALE


# ---- the listener's challenge-response, without sockets ----------------------------------------------


def _card() -> ProducerCard:
    return ProducerCard(MODEL, fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 20, 1 << 24], 8),
                        "prefill-p0", b"metadata", "prefill", 11, ("tcp://127.0.0.1:1",))


def _request(**auth_fields) -> bytes:
    return handshake.make_request(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1 << 28, 1 << 30], 16),
                                  "decode-c0", "decode", **auth_fields)


def _secured() -> ListenerAuth:
    return ListenerAuth(SECRET, auth.Challenges(time.monotonic, 60.0, 16))


def test_metadata_goes_only_to_a_consumer_that_proved_the_secret():
    card, stats, accepted, secured = _card(), ListenerStats(), [], _secured()

    def ask(data: bytes):
        return wire.decode(handshake.answer(card, data, stats, lambda *a: accepted.append(a), secured))[1]

    # Row 1: a peer that knows only the port (no nonce, no proof) gets a refusal naming nothing of ours.
    refusal = ask(_request())
    assert isinstance(refusal, wire.HandshakeReply) and not refusal.accepted and not refusal.agent_metadata
    assert refusal.engine_id == "" and refusal.rank is None and "authentication" in refusal.error
    cn = auth.new_nonce()
    challenge = ask(_request(client_nonce=cn))
    assert isinstance(challenge, wire.AuthChallenge) and challenge.agent_name == "prefill-p0"
    assert challenge.proof == auth.proof(SECRET, "producer", cn, challenge.server_nonce, "prefill-p0", "decode-c0")
    wrong = auth.proof(b"another-secret-0123456789", "consumer", cn, challenge.server_nonce, "prefill-p0",
                       "decode-c0")
    refused = ask(_request(client_nonce=cn, server_nonce=challenge.server_nonce, proof=wrong))
    assert not refused.accepted and refused.cause == "secret" and "(secret)" in refused.error
    right = auth.proof(SECRET, "consumer", cn, challenge.server_nonce, "prefill-p0", "decode-c0")
    second = _request(client_nonce=cn, server_nonce=challenge.server_nonce, proof=right)
    reply = ask(second)
    assert reply.accepted and reply.agent_metadata == b"metadata"
    assert accepted == [("decode-c0", auth.link_key(SECRET, cn, challenge.server_nonce, "prefill-p0", "decode-c0"))]
    replayed = ask(second)  # replaying the proven request gets nothing
    assert not replayed.accepted and replayed.cause == "secret" and "replay" in replayed.error
    assert (stats.accepted, stats.rejected, secured.challenged, secured.unauthenticated) == (1, 3, 1, 3)
    assert stats.causes == {"secret": 3} and secured.replayed == 1


def _prove(ask, cn: bytes, agent: str = "decode-c0") -> bytes:
    challenge = ask(_request(client_nonce=cn)) if agent == "decode-c0" else None
    assert isinstance(challenge, wire.AuthChallenge)
    right = auth.proof(SECRET, "consumer", cn, challenge.server_nonce, "prefill-p0", agent)
    return _request(client_nonce=cn, server_nonce=challenge.server_nonce, proof=right)


def test_every_refusal_names_its_cause_in_the_reply_and_its_text():
    """Row 4: a refusal says secret, capacity, busy (a stale challenge) or incompatible, never blames the secret
    for what was not the secret."""
    now = [100.0]
    card, stats = _card(), ListenerStats()
    secured = ListenerAuth(SECRET, auth.Challenges(lambda: now[0], 5.0, 1))

    def ask(data: bytes):
        return wire.decode(handshake.answer(card, data, stats, lambda *a: None, secured))[1]

    stale = _prove(ask, auth.new_nonce())
    now[0] += 5.0
    busy = ask(stale)
    assert (busy.accepted, busy.cause) == (False, "busy") and "(busy)" in busy.error and "expired" in busy.error
    assert ask(_prove(ask, auth.new_nonce())).accepted
    full = ask(_prove(ask, auth.new_nonce()))  # the record of accepted exchanges holds 1
    assert (full.accepted, full.cause) == (False, "capacity") and "(capacity)" in full.error
    now[0] += 5.0
    assert ask(_prove(ask, auth.new_nonce())).accepted  # the first one's deadline passed: room again
    now[0] += 5.0
    other = RankGeometry(MODEL, 1, 0, CacheOptions(kv_dtype="float32"))
    cn = auth.new_nonce()
    challenge = ask(_request(client_nonce=cn))
    proof = auth.proof(SECRET, "consumer", cn, challenge.server_nonce, "prefill-p0", "decode-c0")
    data = handshake.make_request(fingerprint_of(other), describe_rank(other, [1 << 28, 1 << 30], 16), "decode-c0",
                                  "decode", client_nonce=cn, server_nonce=challenge.server_nonce, proof=proof)
    refused = ask(data)
    assert (refused.accepted, refused.cause) == (False, "incompatible") and "(incompatible)" in refused.error
    assert [d.field for d in refused.differences] == ["kv_dtype"]
    nonce_less = ask(_request())
    assert nonce_less.cause == "secret" and "requires authentication" in nonce_less.error
    assert stats.causes == {"busy": 1, "capacity": 1, "incompatible": 1, "secret": 1} and stats.rejected == 4
    assert set(stats.causes) <= set(wire.REFUSAL_CAUSES)


def test_a_flood_of_first_requests_cannot_push_out_an_honest_challenge(secret_file):
    """Row 4, producer half: thousands of first requests from a process that knows only the port arrive between an
    honest consumer's challenge and its proof, through the real listener's answer function; the proof is accepted."""
    with Producer(HybridCache.allocate(GEOMETRY, 8), EngineConfig(secret_file=secret_file,
                                                                  max_pending_handshakes=64)) as producer:
        def ask(data: bytes):
            return wire.decode(producer._respond(data))[1]

        cn = auth.new_nonce()
        challenge = ask(_request(client_nonce=cn))
        assert isinstance(challenge, wire.AuthChallenge)
        flood_size = 50 * 64  # fifty times the pending-handshake cap
        for i in range(flood_size):
            flood = ask(handshake.make_request(fingerprint_of(GEOMETRY), describe_rank(GEOMETRY, [1, 2], 16),
                                               f"flood-{i}", "flood", client_nonce=auth.new_nonce()))
            assert isinstance(flood, wire.AuthChallenge)
        right = auth.proof(SECRET, "consumer", cn, challenge.server_nonce, challenge.agent_name, "decode-c0")
        reply = ask(_request(client_nonce=cn, server_nonce=challenge.server_nonce, proof=right))
        assert isinstance(reply, wire.HandshakeReply) and reply.accepted, reply.error
        assert reply.cause == "" and producer.listener_stats.accepted == 1
        assert producer.listener_auth.challenged == flood_size + 1
        assert producer.num_pending_handshakes == 1


# ---- a forged handshake against a real producer's side channel ----------------------------------------


def _raw_exchange(address: str, data: bytes) -> object:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sock.send(data)
        assert sock.poll(int(WAIT_S * 1000)), "no answer"
        return wire.decode(sock.recv())[1]
    finally:
        ctx.destroy(linger=0)


def test_a_flood_over_the_real_socket_leaves_an_honest_challenge_valid(secret_file):
    """Row 4 over the producer's ROUTER: 2,000 first requests from one DEALER between the honest steps 2 and 3."""
    with Producer(HybridCache.allocate(GEOMETRY, 8), EngineConfig(secret_file=secret_file,
                                                                  max_pending_handshakes=64)) as producer:
        cn = auth.new_nonce()
        challenge = _raw_exchange(producer.address, _request(client_nonce=cn))
        assert isinstance(challenge, wire.AuthChallenge)
        ctx = zmq.Context()
        try:
            flood = ctx.socket(zmq.DEALER)
            flood.setsockopt(zmq.LINGER, 0)
            flood.connect(producer.address)
            rank = describe_rank(GEOMETRY, [1, 2], 16)
            answered = 0
            for i in range(2000):
                flood.send(handshake.make_request(fingerprint_of(GEOMETRY), rank, f"flood-{i}", "flood",
                                                  client_nonce=auth.new_nonce()))
                while flood.poll(0):
                    answered += isinstance(wire.decode(flood.recv())[1], wire.AuthChallenge)
            while answered < 2000 and flood.poll(int(WAIT_S * 1000)):
                answered += isinstance(wire.decode(flood.recv())[1], wire.AuthChallenge)
            assert answered == 2000
        finally:
            ctx.destroy(linger=0)
        right = auth.proof(SECRET, "consumer", cn, challenge.server_nonce, challenge.agent_name, "decode-c0")
        reply = _raw_exchange(producer.address, _request(client_nonce=cn, server_nonce=challenge.server_nonce,
                                                         proof=right))
        assert isinstance(reply, wire.HandshakeReply) and reply.accepted, reply.error
        assert producer.listener_stats.accepted == 1 and producer.num_pending_handshakes == 1


def test_a_forger_that_knows_only_the_port_gets_no_metadata(secret_file, caplog):
    caplog.set_level(logging.DEBUG)
    with Producer(HybridCache.allocate(GEOMETRY, 8), EngineConfig(secret_file=secret_file)) as producer:
        reply = _raw_exchange(producer.address, _request())
        assert isinstance(reply, wire.HandshakeReply) and not reply.accepted
        assert reply.agent_metadata == b"" and reply.engine_addresses == () and reply.agent_name == ""
        # Guessing at the challenge does not help either.
        cn = auth.new_nonce()
        challenge = _raw_exchange(producer.address, _request(client_nonce=cn))
        assert isinstance(challenge, wire.AuthChallenge)
        guess = _raw_exchange(producer.address, _request(client_nonce=cn, server_nonce=challenge.server_nonce,
                                                         proof=b"\x00" * 32))
        assert isinstance(guess, wire.HandshakeReply) and not guess.accepted and guess.agent_metadata == b""
        assert producer.num_pending_handshakes == 0 and producer.listener_stats.accepted == 0
    assert SECRET.decode() not in caplog.text


def test_a_secret_on_one_side_only_is_refused_both_ways(secret_file, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    cache = HybridCache.allocate(GEOMETRY, 8)
    with Producer(cache, EngineConfig(secret_file=secret_file)) as producer, Consumer(
            HybridCache.allocate(GEOMETRY, 8), EngineConfig()) as consumer:
        with pytest.raises(HandshakeError, match="requires authentication"):
            consumer.connect(producer.address, timeout_s=WAIT_S)
    with Producer(cache, EngineConfig()) as producer, Consumer(
            HybridCache.allocate(GEOMETRY, 8), EngineConfig(secret_file=secret_file)) as consumer:
        with pytest.raises(HandshakeError, match="without proving the shared secret"):  # no downgrade
            consumer.connect(producer.address, timeout_s=WAIT_S)


def test_without_a_secret_one_warning_says_so(monkeypatch, caplog):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    monkeypatch.setattr(auth, "_warned_open", False)
    caplog.set_level(logging.WARNING, logger="hybrid_transfer.engine.auth")
    with Producer(HybridCache.allocate(GEOMETRY, 8)), Producer(HybridCache.allocate(GEOMETRY, 8)):
        pass
    lines = [r for r in caplog.records if "no shared secret" in r.getMessage()]
    assert len(lines) == 1 and "read and write registered memory" in lines[0].getMessage()


# ---- real NIXL agents across processes, secret on --------------------------------------------------


def _stats(worker, key, producer: bool) -> dict:
    return worker.call("producer_status" if producer else "consumer_status", key)["stats"]


def _wait(worker, key, producer: bool, **expected) -> dict:
    deadline = time.monotonic() + WAIT_S
    while True:
        stats = _stats(worker, key, producer)
        if all(stats[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            assert {k: stats[k] for k in expected} == expected
            return stats
        worker.call("settle", 0.02)


def test_forged_replayed_and_rank_spoofing_notifications_are_dropped_and_counted(cluster, secret_file):
    """1 -> 2 fan-out with a secret (and the side channel under CURVE): the producer frees only after both
    real ranks read (row 3)."""
    config = EngineConfig(secret_file=secret_file, side_channel_curve=True)
    p_worker, c_workers = cluster.workers[0], cluster.workers[1:3]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)], config)
    consumers = start_consumers(c_workers, [RankSpec(TINY, 2, r, 16) for r in range(2)], config)
    try:
        layout = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
        ticket = wire.decode_ticket(hold_everywhere(producers, "r", layout, seed=9))
        pk, p_status = producers.keys[0], p_worker.call("producer_status", producers.keys[0])
        name, digest = p_status["agent_name"], p_status["digest"]
        (c0, c1), (k0, k1) = consumers.workers, consumers.keys
        c0.call("call", record_sends, k0)
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("connect", k, producers.addresses[0], WAIT_S)
        _wait(p_worker, pk, True, hellos=2)
        assert p_worker.call("producer_status", pk)["listener"]["accepted"] == 2

        def completion(**changes):
            fields = dict(request_id="r", nonce=ticket.nonce, consumer_rank=0, expected_consumers=2) | changes
            return wire.encode(wire.Completion(**fields), digest)

        # Under c0's own agent name, with the ticket's nonce: an unsealed completion and an unsealed Bye, a
        # sealed one with a made-up MAC, a properly sealed one that claims rank 1, and a heartbeat replayed.
        c0.call("call", raw_notify, k0, name, completion())
        c0.call("call", raw_notify, k0, name, wire.encode(wire.Bye(consumer_rank=0), digest))
        forged = wire.Sealed(counter=1 << 40, mac=b"\x01" * 32, message=completion())
        c0.call("call", raw_notify, k0, name, wire.encode(forged, digest))
        assert c0.call("call", sealed_notify, k0, name, completion(consumer_rank=1, expected_consumers=2))
        heartbeat = wire.Heartbeat(consumer_rank=0, requests=(wire.RequestRef("r", ticket.nonce),))
        assert c0.call("call", sealed_notify, k0, name, wire.encode(heartbeat, digest))
        _wait(p_worker, pk, True, renewals=1)
        assert c0.call("call", replay_sent, k0, "HEARTBEAT") == 1
        assert c0.call("call", replay_sent, k0, "HELLO") == 1
        stats = _wait(p_worker, pk, True, rejected=6)
        assert p_worker.call("call", rejections, pk) == {"unsealed": 2, "mac": 1, "rank": 1, "replay": 2}
        assert stats["completions"] == 0 and stats["byes"] == 0 and stats["renewals"] == 1
        assert p_worker.call("producer_status", pk, ["r"])["held"] == ["r"]
        # The producer's side: an unsealed Revoke under the producer's agent name is dropped by c1.
        c1_name = c1.call("consumer_status", k1)["agent_name"]
        p_worker.call("call", raw_notify, pk, c1_name, wire.encode(
            wire.Revoke(request=wire.RequestRef("r", ticket.nonce), lease_s=60.0), digest))
        _wait(c1, k1, False, rejected=1)
        # The real reads: both DONE with the right bytes, and only then is the request freed, once.
        for w, k, local in ((c0, k0, [[0, 1, 2], [3], [4], [5]]), (c1, k1, [[6, 7, 8], [9], [10], [11]])):
            w.call("start_read", k, wire.encode_ticket(ticket), local, 20)
        for w, k, local in ((c0, k0, ((0, 1, 2), (3,), (4,), (5,))), (c1, k1, ((6, 7, 8), (9,), (10,), (11,)))):
            assert w.call("wait_done", k, ["r"], WAIT_S)[0].state == "done"
            w.call("check", k, [(RequestLayout(local, 20), 9)])
        assert p_worker.call("wait_freed", pk, ["r"], WAIT_S) == ["r"]
        stats = _stats(p_worker, pk, True)
        assert stats["completions"] == 2 and stats["freed"] == 1 and stats["malformed"] == 0
    finally:
        producers.close()
        consumers.close()


# ---- fuzzed decoders of the new messages -------------------------------------------------------------

NEW_BODIES = [
    wire.AuthChallenge(server_nonce=b"s" * 32, proof=b"p" * 32, agent_name="prefill-p0"),
    wire.Sealed(counter=7, mac=b"m" * 32, message=wire.encode(wire.Bye(consumer_rank=0), DIGEST)),
    wire.HandshakeRequest(fingerprint=fingerprint_of(GEOMETRY), rank=describe_rank(GEOMETRY, [4096, 1 << 20], 8),
                          agent_name="d", engine_id="e", client_nonce=b"c" * 32, server_nonce=b"s" * 32,
                          proof=b"p" * 32),
]


@pytest.mark.parametrize("body", NEW_BODIES, ids=lambda b: type(b).__name__)
def test_the_new_messages_round_trip_and_every_truncation_is_our_error(body):
    assert_round_trip_and_truncations(body, DIGEST)


def test_oversized_nonces_and_macs_are_refused_while_decoding():
    too_long = msgspec.msgpack.encode(wire.AuthChallenge(server_nonce=b"s" * 65, proof=b"p", agent_name="a"))
    env = wire.Envelope(wire.PROTOCOL_VERSION, DIGEST, wire.Kind.AUTH_CHALLENGE, too_long)
    with pytest.raises(WireDecodeError, match="server_nonce"):
        wire.decode(msgspec.msgpack.encode(env))


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzzed_new_messages_decode_or_raise_our_error(data):
    decode_bit_flipped(data, data.draw(st.sampled_from(NEW_BODIES)), DIGEST)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, (1 << 63) - 1), st.binary(max_size=64), st.binary(max_size=256))
def test_a_fuzzed_sealed_message_fails_the_link_check_and_nothing_else(counter, mac, inner):
    link = auth.Link.for_producer(b"k" * 32)
    data = wire.encode(wire.Sealed(counter=counter, mac=mac, message=inner), DIGEST)
    sealed = wire.decode(data, wire.Kind.SEALED)[1]
    with pytest.raises(auth.Rejected):
        link.check(sealed.counter, sealed.mac, sealed.message)


# ---- optional CURVE encryption of the side channel -----------------------------------------------------


def test_curve_needs_a_secret(monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="side_channel_curve"):
        Producer(HybridCache.allocate(GEOMETRY, 8), EngineConfig(side_channel_curve=True))


def test_with_curve_only_peers_that_know_the_secret_are_answered(secret_file, monkeypatch):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    curve = EngineConfig(secret_file=secret_file, side_channel_curve=True)
    with Producer(HybridCache.allocate(GEOMETRY, 8), curve) as producer:
        # A plain ZeroMQ peer gets no answer at all (the CURVE handshake never completes).
        ctx = zmq.Context()
        try:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(producer.address)
            sock.send(_request())
            assert not sock.poll(1000)
        finally:
            ctx.destroy(linger=0)
        # A consumer with the secret but without CURVE cannot handshake either.
        with Consumer(HybridCache.allocate(GEOMETRY, 8), EngineConfig(secret_file=secret_file)) as plain:
            with pytest.raises(HandshakeError):
                plain.connect(producer.address, timeout_s=1.0)
        with Consumer(HybridCache.allocate(GEOMETRY, 8), curve) as consumer:
            consumer.connect(producer.address, timeout_s=WAIT_S)
        assert producer.listener_stats.accepted == 1


def test_pack_mode_staging_queries_travel_under_curve(cluster, secret_file):
    """The consumer's staging queries use the encrypted side channel too: every source is read packed."""
    from pack_ops import run_pack
    from test_transfer import TOPOLOGIES

    from hybrid_transfer.plan.types import PlanMode

    p, d, p_opts, c_opts = TOPOLOGIES["1->2"]
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20, secret_file=secret_file, side_channel_curve=True)
    tokens = (37, 64, 1, 0, 100)
    results, _, c_status, _ = run_pack(cluster, p, d, p_opts, c_opts, config, token_counts=tokens)
    for per_rank in results:
        assert [(r.num_packed_sources, r.num_fallback_sources) for r in per_rank] == [
            (1 if n else 0, 0) for n in tokens]
    assert all(s["stats"]["fallback_absent"] == 0 for s in c_status), c_status


# ---- no repr() reachable from a live authenticated pair shows a key (issue 19, row 7) ------------------------


def _reachable(*roots, limit: int = 400_000) -> list:
    """Every object reachable from ``roots`` through instances and containers (not through classes, modules,
    functions or code, which lead to the whole process), tensors and arrays left out."""
    import gc
    import types

    import numpy as np
    import torch

    leaves = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
              types.CodeType, types.FrameType, types.GeneratorType, torch.Tensor, np.ndarray, logging.Logger)
    seen, stack, out = set(), list(roots), []
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, leaves):
            continue
        seen.add(id(obj))
        out.append(obj)
        assert len(out) < limit, "the walk left the engines' objects"
        if not isinstance(obj, (bytes, bytearray, str, memoryview)):
            stack.extend(gc.get_referents(obj))
    return out


def _keys_of(producer: Producer, consumer: Consumer) -> list[bytes]:
    process_key = getattr(producer.listener_auth.challenges, "_key", None)  # the server nonces' key (auth.Challenges)
    keys = [SECRET, auth.curve_seed(SECRET)] + ([process_key] if process_key else [])
    keys += [r.link.key for r in producer._peers.values() if r.link is not None]
    keys += [o.link.key for o in _reachable(consumer) if isinstance(o, PeerRecord) and o.link is not None]
    return keys


def test_no_repr_reachable_from_an_authenticated_pair_shows_a_key(secret_file):
    config = EngineConfig(secret_file=secret_file, side_channel_curve=True)
    with Producer(HybridCache.allocate(GEOMETRY, 16), config) as producer, Consumer(
            HybridCache.allocate(GEOMETRY, 16), config) as consumer:
        consumer.connect(producer.address, timeout_s=WAIT_S)
        ticket = producer.hold("r", [[1], [2], [3], [4]], 4)
        consumer.start_read(ticket, [[5], [6], [7], [8]])
        deadline, results = time.monotonic() + WAIT_S, []
        while not results and time.monotonic() < deadline:
            results = consumer.poll()
            producer.poll()
        assert [r.state.value for r in results] == ["done"]
        producer.hold("kept", [[9], [10], [11], [12]], 4)  # a live hold and ticket too
        keys = _keys_of(producer, consumer)
        assert len(keys) >= 4  # the secret, the CURVE seed, both ends of the link (and the process key)
        from zmq.utils import z85

        needles = {k for key in keys for k in (repr(bytes(key))[2:-1], key.hex())}
        needles |= {z85.encode(key).decode() for key in keys if len(key) % 4 == 0}  # CURVE keys travel as z85
        objects = _reachable(producer, consumer)
        links = [o for o in objects if isinstance(o, auth.Link)]
        assert len(links) >= 2 and len(objects) > 200  # the walk reached the links inside the records
        shown = 0
        for obj in objects:
            if isinstance(obj, (bytes, bytearray, memoryview)):
                continue  # the key's own bytes (nothing prints them but a repr of a holder)
            try:
                text = obj if isinstance(obj, str) else repr(obj)
            except Exception:  # noqa: BLE001 - a binding's object that cannot print holds nothing of ours
                continue
            shown += 1
            leaked = [n for n in needles if n in text]
            assert not leaked, f"repr of a {type(obj).__name__} shows a key"
        assert shown > 200


@settings(max_examples=60, deadline=None)
@given(key=st.binary(min_size=1, max_size=64), label=st.binary(max_size=16),
       parts=st.lists(st.one_of(st.binary(max_size=80), st.text(max_size=20)), max_size=6))
def test_the_one_call_mac_is_the_length_prefixed_hmac_of_label_then_parts(key, label, parts):
    import hashlib
    import hmac

    streamed = hmac.new(key, label, hashlib.sha256)  # the MAC as the wire defines it, fed part by part
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        streamed.update(len(data).to_bytes(4, "big"))
        streamed.update(data)
    assert auth._mac(key, label, *parts) == streamed.digest()
    if len(parts) >= 2:  # the length prefix keeps a moved boundary from hashing alike
        first = [p.encode() if isinstance(p, str) else p for p in parts[:2]]
        assert auth._mac(key, label, first[0] + first[1], *parts[2:]) != auth._mac(key, label, *parts)
