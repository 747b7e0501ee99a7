"""LeaseBook: expiry on one clock, renewals that never shorten a lease, each expiry reported once."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from hybrid_transfer.engine.lifecycle.lease import LeaseBook


def test_a_lease_ends_lease_s_after_its_start_or_last_renewal():
    book = LeaseBook(10.0)
    assert book.start("a", 0.0) == 10.0 and book.start("b", 5.0) == 15.0
    assert book.renew("a", 8.0) == 18.0 and book.renew("a", 2.0) == 18.0  # never earlier
    assert book.renew("nobody", 1.0) is None
    assert book.pop_expired(14.9) == [] and book.pop_expired(15.0) == ["b"]
    assert book.pop_expired(100.0) == ["a"] and book.pop_expired(200.0) == [] and len(book) == 0


def test_a_dropped_lease_never_expires():
    book = LeaseBook(1.0)
    book.start("a", 0.0)
    book.drop("a")
    assert book.pop_expired(5.0) == [] and book.expires_at("a") is None


OPS = st.lists(st.tuples(st.sampled_from(["start", "renew", "drop", "tick"]), st.integers(0, 5),
                         st.floats(0.0, 3.0)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_expiries_match_a_plain_dict(ops):
    book, oracle, now = LeaseBook(2.5), {}, 0.0
    for op, i, dt in ops:
        rid = f"r{i}"
        if op == "start" and rid not in oracle:
            oracle[rid] = book.start(rid, now)
        elif op == "renew" and rid in oracle:
            oracle[rid] = max(oracle[rid], now + 2.5)
            assert book.renew(rid, now) == oracle[rid]
        elif op == "drop":
            book.drop(rid)
            oracle.pop(rid, None)
        elif op == "tick":
            now += dt
            due = sorted(r for r, until in oracle.items() if until <= now)
            assert sorted(book.pop_expired(now)) == due
            for r in due:
                del oracle[r]
    assert len(book) == len(oracle)
