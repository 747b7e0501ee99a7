"""Single-use tickets (issue 14, row 2): replayed and edited tickets end FAILED with a typed cause, never DONE.

Real NIXL agents in separate processes (harness workers), without a secret: the producer's own record
of each hold is the authority, so a replay or an edit is caught either way. Claims are unit-tested
through the producer-side bookkeeping (claims.py) as well.
"""

from __future__ import annotations

import msgspec
import pytest
from auth_ops import failure_causes
from harness import TINY, RankSpec, hold_everywhere, start_consumers, start_producers
from hypothesis import given, settings
from hypothesis import strategies as st
from wire_checks import assert_round_trip_and_truncations, decode_bit_flipped

from hybrid_transfer.engine import claims, wire
from hybrid_transfer.layout import RankGeometry, fingerprint_of, model_from_config
from hybrid_transfer.verify import RequestLayout

DIGEST = fingerprint_of(RankGeometry(model_from_config(TINY, name="tiny"), 1, 0)).digest()
WAIT_S = 30.0
LAYOUT = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
OTHER = RequestLayout(((5, 6), (7,), (8,), (9,)), 20)
LOCAL = [[[0, 1, 2], [3], [4], [5]], [[6, 7, 8], [9], [10], [11]]]


def _local(i: int) -> RequestLayout:
    return RequestLayout(tuple(tuple(g) for g in LOCAL[i]), 20)


def test_digest_covers_every_field_that_decides_the_bytes():
    base = ("e", 7, "r", 5, ((1, 2), (3,)), 20, 20)
    digest = claims.ticket_digest(*base)
    for i, changed in enumerate([("f",), (8,), ("s",), (6,), (((1, 3), (3,)),), (21,), (19,)]):
        other = base[:i] + changed + base[i + 1:]
        assert claims.ticket_digest(*other) != digest, i


def test_a_ticket_mac_is_keyed_by_the_secret_and_covers_the_fields():
    ticket = wire.Ticket(engine_id="e", incarnation=7, addresses=("tcp://h:1",), tp_size=1, request_id="r", nonce=5,
                         block_ids=((1, 2), (3,)), num_tokens=20, state_position=20, lease_s=30.0)
    secret = b"k" * 32
    signed = claims.sign(ticket, secret)
    assert claims.mac_ok(signed, secret) and not claims.mac_ok(signed, b"x" * 32)
    assert not claims.mac_ok(msgspec.structs.replace(signed, block_ids=((1, 3), (3,))), secret)
    assert not claims.mac_ok(ticket, secret) and claims.mac_ok(ticket, None)  # unsigned: only without a secret
    assert not claims.mac_ok(claims.sign(msgspec.structs.replace(ticket, num_tokens=21), None), secret)
    assert wire.decode_ticket(wire.encode_ticket(signed)) == signed


def test_ended_tickets_are_remembered_for_one_lease_in_bounded_memory():
    now = [0.0]
    ended = claims.EndedTickets(lambda: now[0], lease_s=10.0, capacity=3)
    for i in range(5):
        ended.add(f"r{i}", i)
    assert len(ended) == 3 and ("r0", 0) not in ended and ("r4", 4) in ended
    now[0] = 10.0
    assert ("r4", 4) not in ended and len(ended) == 0


def test_replayed_and_edited_tickets_fail_with_a_typed_cause_and_never_free_a_live_hold(cluster):
    """1 -> 2 fan-out; a second decode engine's rank 0 replays and edits the tickets of the first."""
    p_worker, (a0, a1, b0) = cluster.workers[0], cluster.workers[1:4]
    producers = start_producers([p_worker], [RankSpec(TINY, 1, 0, 16)])
    first = start_consumers([a0, a1], [RankSpec(TINY, 2, r, 16) for r in range(2)])
    second = start_consumers([b0], [RankSpec(TINY, 2, 0, 16)])
    pk, (ka0, ka1), kb0 = producers.keys[0], first.keys, second.keys[0]
    try:
        # r1: rank 0 of the first engine reads it (claim confirmed); the hold still waits for rank 1.
        t1 = hold_everywhere(producers, "r1", LAYOUT, seed=1)
        a0.call("start_read", ka0, t1, LOCAL[0], 20)
        assert a0.call("wait_done", ka0, ["r1"], WAIT_S)[0].state == "done"
        a0.call("check", ka0, [(_local(0), 1)])
        # The same ticket from another engine's rank 0: rank 0 already claimed it.
        b0.call("start_read", kb0, t1, LOCAL[0], 20)
        replay = b0.call("wait_done", kb0, ["r1"], WAIT_S)[0]
        assert (replay.state, replay.error_type) == ("failed", "TicketClaimError") and "claimed" in replay.error_message
        # An edited copy (other block ids) fails at once on its MAC: nothing is read.
        posted = b0.call("consumer_status", kb0)["stats"]["reads_posted"]
        edited = msgspec.structs.replace(wire.decode_ticket(t1), block_ids=OTHER.block_ids)
        b0.call("start_read", kb0, wire.encode_ticket(edited), LOCAL[1], 20)
        result = b0.call("wait_done", kb0, ["r1"], WAIT_S)[0]
        assert (result.state, result.error_type) == ("failed", "TicketClaimError") and "MAC" in result.error_message
        assert b0.call("consumer_status", kb0)["stats"]["reads_posted"] == posted
        # Without a secret anyone can recompute the MAC (a checksum then): the producer's record catches it.
        b0.call("start_read", kb0, wire.encode_ticket(claims.sign(edited, None)), LOCAL[1], 20)
        result = b0.call("wait_done", kb0, ["r1"], WAIT_S)[0]
        assert (result.state, result.error_type) == ("failed", "TicketClaimError") and "edited" in result.error_message
        assert b0.call("call", failure_causes, kb0) == {"ticket_replayed": 1, "ticket_edited": 2}
        p_worker.call("settle", 0.3)
        assert p_worker.call("producer_status", pk, ["r1"])["held"] == ["r1"]
        # Rank 1 of the first engine reads for real: DONE, right bytes, and the hold is freed once.
        a1.call("start_read", ka1, t1, LOCAL[1], 20)
        assert a1.call("wait_done", ka1, ["r1"], WAIT_S)[0].state == "done"
        a1.call("check", ka1, [(_local(1), 1)])
        assert p_worker.call("wait_freed", pk, ["r1"], WAIT_S) == ["r1"]
        # r2 re-holds the same blocks with other bytes; replaying r1's ticket now reads r2's bytes, but
        # the producer answers that r1 ended: FAILED, never DONE with another request's bytes.
        hold_everywhere(producers, "r2", LAYOUT, seed=2)
        b0.call("start_read", kb0, t1, LOCAL[0], 20)
        late = b0.call("wait_done", kb0, ["r1"], WAIT_S)[0]
        assert (late.state, late.error_type) == ("failed", "TicketClaimError") and "ended" in late.error_message
        assert b0.call("call", failure_causes, kb0) == {"ticket_replayed": 2, "ticket_edited": 2}
        stats = p_worker.call("producer_status", pk)["stats"]
        assert (stats["claims_confirmed"], stats["claims_refused"], stats["freed"]) == (2, 3, 1)
        assert stats["completions"] == 2  # the refused claims reported nothing
    finally:
        producers.close()
        first.close()
        second.close()


NEW_BODIES = [
    wire.Claim(request_id="r", nonce=5, consumer_rank=1, digest=b"d" * 32),
    wire.ClaimReply(request=wire.RequestRef("r", 5), consumer_rank=1, status=wire.ClaimStatus.EDITED),
]


@pytest.mark.parametrize("body", NEW_BODIES, ids=lambda b: type(b).__name__)
def test_claims_round_trip_and_every_truncation_is_our_error(body):
    assert_round_trip_and_truncations(body, DIGEST)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_fuzzed_claims_decode_or_raise_our_error(data):
    decode_bit_flipped(data, data.draw(st.sampled_from(NEW_BODIES)), DIGEST)


def test_a_producer_with_a_secret_refuses_an_unsigned_or_edited_ticket(tmp_path):
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import EngineConfig, Producer
    from hybrid_transfer.errors import TicketMismatchError

    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef")
    geometry = RankGeometry(model_from_config(TINY, name="tiny"), 1, 0)
    with Producer(HybridCache.allocate(geometry, 16), EngineConfig(secret_file=str(secret))) as producer:
        good = producer.hold("a", LAYOUT.block_ids, LAYOUT.num_tokens)
        assert claims.mac_ok(good, b"0123456789abcdef0123456789abcdef") and not claims.mac_ok(good, None)
        for bad in (msgspec.structs.replace(good, request_id="b", mac=b""),
                    claims.sign(msgspec.structs.replace(good, request_id="b"), None)):
            with pytest.raises(TicketMismatchError) as info:
                producer.hold("b", ticket=bad)
            assert [d[0] for d in info.value.differences] == ["mac"] and not producer.is_held("b")
