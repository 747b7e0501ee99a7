"""A hold answers to its reader (issue 19, row 3; docs/lifecycle.md#who-reports).

Two decode engines hold the same ticket: A reads it, B aborts or declines at every stage. Real NIXL
agents in separate processes (loopback DRAM), without a secret and with one (B then holds the secret
and seals its reports under its own link): B's reports reach the producer under B's own handshaken agent. On CPU a READ's bytes may land at post time, so the bytes alone prove little; the test
checks the protocol: while A's confirmed claim is unreported the hold stays HELD and its blocks stay
pinned, whatever B sends, and A then ends DONE with the right bytes. B is made to send every kind of
report: ``Consumer.decline``, a read aborted before its claim is answered, and raw DONE, FAILED and
ABORTED completions of A's consumer rank.
"""

from __future__ import annotations

import time

import msgspec
import pytest
from api_ops import decline
from auth_ops import sealed_notify
from harness import TINY, RankSpec, hold_everywhere, raw_notify, start_consumers, start_producers
from lifecycle_ops import abort, resume, status, wait_results

from hybrid_transfer.engine import EngineConfig, wire
from hybrid_transfer.verify import RequestLayout

WAIT_S = 30.0
LAYOUT = RequestLayout(((0, 1), (2,), (3,), (4,)), 20)
LOCAL = RequestLayout(((0, 1, 2), (3,), (4,), (5,)), 20)
B_LOCAL = RequestLayout(((6, 7, 8), (9,), (10,), (11,)), 20)
CONFIG = EngineConfig(lease_s=600.0, read_deadline_s=120.0)  # neither the lease nor a deadline ends anything here


# ---- worker-side helpers (run through harness ``call``) --------------------------------------------
def read_and_pause(state, key, ticket_bytes, block_ids, num_tokens) -> None:
    """Start a read and stop polling the rank in the same command: its claim is out, nothing comes back."""
    state.ranks[key].engine.start_read(wire.decode_ticket(ticket_bytes), block_ids, expected_state_position=num_tokens)
    state.extra[f"{key}/paused"] = state.ranks.pop(key)


def read_then_abort(state, key, ticket_bytes, block_ids, num_tokens) -> None:
    """Start a read and abort it before anything is polled: the claim and the ABORTED report leave together."""
    consumer = state.ranks[key].engine
    ticket = wire.decode_ticket(ticket_bytes)
    consumer.start_read(ticket, block_ids, expected_state_position=num_tokens)
    consumer.abort(ticket.request_id)


def agent_name(state, key) -> str:
    return state.ranks[key].engine.agent.name


# ---- the test side ---------------------------------------------------------------------------------
def _until(what: str, check):
    deadline = time.monotonic() + WAIT_S
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)
    return value


class _Setup:
    def __init__(self, cluster, secret_file: str | None):
        self.p_worker, self.a_worker, self.b_worker = cluster.workers[0:3]
        self.secret = secret_file is not None
        config = msgspec.structs.replace(CONFIG, secret_file=secret_file)
        self.producers = start_producers([self.p_worker], [RankSpec(TINY, 1, 0, 16)], config)
        self.a = start_consumers([self.a_worker], [RankSpec(TINY, 1, 0, 16)], config)
        self.b = start_consumers([self.b_worker], [RankSpec(TINY, 1, 0, 16)], config)
        self.pk, self.ak, self.bk = self.producers.keys[0], self.a.keys[0], self.b.keys[0]
        self.digest = self.p_worker.call("producer_status", self.pk)["digest"]
        self.p_name = self.p_worker.call("call", agent_name, self.pk)
        self.a_paused = False

    def p_status(self, rids=()):
        return self.p_worker.call("call", status, self.pk, list(rids))

    def b_link(self) -> None:
        self.b_worker.call("connect", self.bk, self.producers.addresses[0], 10.0)
        _until("B's welcome", self.b_linked)

    def a_linked(self) -> bool:
        return self.a_worker.call("call", status, self.ak)["stats"]["welcomes"] > 0

    def b_linked(self) -> bool:
        return self.b_worker.call("call", status, self.bk)["stats"]["welcomes"] > 0

    def b_raw(self, ticket: wire.Ticket, kind: wire.CompletionKind) -> None:
        """B's agent reports A's consumer rank (0) on the ticket, as any handshaken agent can send."""
        message = wire.encode(wire.Completion(request_id=ticket.request_id, nonce=ticket.nonce, consumer_rank=0,
                                              expected_consumers=1, kind=kind), self.digest)
        if self.secret:
            assert self.b_worker.call("call", sealed_notify, self.bk, self.p_name, message)
        else:
            self.b_worker.call("call", raw_notify, self.bk, self.p_name, message)

    def wait_stat(self, name: str, value: int) -> dict:
        return _until(f"{name} == {value}", lambda: (s := self.p_status())["stats"][name] == value and s)

    def close(self) -> None:
        if self.a_paused:
            self.a_worker.call("call", resume, self.ak)
        self.producers.close()
        self.a.close()
        self.b.close()


@pytest.fixture(params=["open", "secret"])
def setup(cluster, request, tmp_path):
    secret_file = None
    if request.param == "secret":
        path = tmp_path / "secret"
        path.write_bytes(b"second-reader test secret, 32 bytes or more\n")
        secret_file = str(path)
    s = _Setup(cluster, secret_file)
    yield s
    s.close()


def _reports_taken(st: dict) -> int:
    """Reports of a held request the producer has acted on, whatever it made of them."""
    stats = st["stats"]
    return stats.get("not_reader", 0) + stats["completions"] + stats["duplicate"] + stats["inconsistent"]


def _assert_held(s: _Setup, rid: str, reports_ignored: int) -> None:
    _until(f"{reports_ignored} reports", lambda: _reports_taken(s.p_status()) >= reports_ignored)
    s.p_worker.call("settle", 0.1)  # anything B sent after that is taken in too
    st = s.p_status([rid])
    assert st["holds"] == {rid: "held"} and st["pinned_blocks"] == 5, st
    assert st["stats"]["freed"] == 0 and st["stats"]["completions"] == 0 and st["terminal"] == {}
    assert st["stats"]["not_reader"] == reports_ignored


def test_row3_while_a_confirmed_reader_is_unreported_nothing_b_sends_frees_the_hold(setup):
    s = setup
    ticket_bytes = hold_everywhere(s.producers, "r1", LAYOUT, seed=31)
    ticket = wire.decode_ticket(ticket_bytes)
    s.a_worker.call("connect", s.ak, s.producers.addresses[0], 10.0)
    _until("A's welcome", s.a_linked)
    s.a_worker.call("call", read_and_pause, s.ak, ticket_bytes, LOCAL.block_ids, 20)
    s.a_paused = True
    s.wait_stat("claims_confirmed", 1)  # A's claim for rank 0 is confirmed; A reports nothing while paused
    # B declines through the API (it handshakes first), then reads and aborts before its claim is answered.
    assert s.b_worker.call("call", decline, s.bk, ticket_bytes) is True
    _assert_held(s, "r1", 1)
    s.b_link()  # welcomed, so its read posts (and claims) at once
    s.b_worker.call("call", read_then_abort, s.bk, ticket_bytes, B_LOCAL.block_ids, 20)
    _assert_held(s, "r1", 2)
    st = s.p_status()
    assert st["stats"]["claims_refused"] == 1 and st["stats"]["claims_confirmed"] == 1  # B's claim: CLAIMED
    b_result = s.b_worker.call("call", wait_results, s.bk, ["r1"], WAIT_S)["r1"]
    assert b_result is not None and b_result["state"] == "aborted", b_result
    # Raw reports of rank 0 from B's handshaken agent: every kind is ignored.
    for n, kind in enumerate((wire.CompletionKind.DONE, wire.CompletionKind.FAILED, wire.CompletionKind.ABORTED)):
        s.b_raw(ticket, kind)
        _assert_held(s, "r1", 3 + n)
    # A reads on: DONE with r1's bytes, and its report frees the hold.
    s.a_worker.call("call", resume, s.ak)
    s.a_paused = False
    result = s.a_worker.call("call", wait_results, s.ak, ["r1"], WAIT_S)["r1"]
    assert result is not None and (result["state"], result["cause"]) == ("done", None), result
    s.a_worker.call("check", s.ak, [(LOCAL, 31)])
    assert s.p_worker.call("wait_freed", s.pk, ["r1"], WAIT_S) == ["r1"]
    st = s.p_status(["r1"])
    assert st["terminal"] == {"freed": 1} and st["pinned_blocks"] == 0
    assert st["stats"]["completions"] == 1 and st["stats"]["not_reader"] == 5


def test_row3_before_any_claim_a_report_ends_the_hold_and_a_late_reader_never_reports_done(setup):
    """The honest path for a request dropped before its read (a decline), or read from elsewhere (a DONE of a
    rank with nothing to read here): the report frees at once, and a READ that comes later (or was in flight)
    is answered ENDED at its claim, so it fails instead of trusting the bytes of the next hold."""
    s = setup
    s.b_link()
    for n, how in enumerate(("decline", "done", "read and abort")):
        rid, next_rid = f"r{n}", f"next{n}"
        ticket_bytes = hold_everywhere(s.producers, rid, LAYOUT, seed=32 + n)
        if how == "decline":
            assert s.b_worker.call("call", decline, s.bk, ticket_bytes) is True
        elif how == "done":
            s.b_raw(wire.decode_ticket(ticket_bytes), wire.CompletionKind.DONE)
        else:  # B's claim comes first, so B is the reader; its abort ends the hold
            s.b_worker.call("call", read_then_abort, s.bk, ticket_bytes, B_LOCAL.block_ids, 20)
        assert s.p_worker.call("wait_freed", s.pk, [rid], WAIT_S) == [rid]
        hold_everywhere(s.producers, next_rid, LAYOUT, seed=40 + n)  # the same blocks, other bytes
        s.a_worker.call("start_read", s.ak, ticket_bytes, LOCAL.block_ids, 20)
        result = s.a_worker.call("call", wait_results, s.ak, [rid], WAIT_S)[rid]
        assert result is not None and (result["state"], result["cause"]) == ("failed", "ticket_replayed"), result
        assert s.p_status([next_rid])["holds"] == {next_rid: "held"}
        assert s.p_worker.call("call", abort, s.pk, next_rid)
        assert s.p_worker.call("wait_freed", s.pk, [next_rid], WAIT_S) == [next_rid]
    st = s.p_status()
    assert st["terminal"] == {"freed": 3, "aborted": 3} and st["stats"]["claims_refused"] == 3
    assert st["stats"]["claims_confirmed"] == 1 and st["stats"]["not_reader"] == 0


def test_row3_after_the_readers_done_late_reports_touch_no_later_hold_of_the_blocks(setup):
    s = setup
    t1 = hold_everywhere(s.producers, "r1", LAYOUT, seed=34)
    s.a_worker.call("start_read", s.ak, t1, LOCAL.block_ids, 20)
    result = s.a_worker.call("call", wait_results, s.ak, ["r1"], WAIT_S)["r1"]
    assert result is not None and result["state"] == "done", result
    s.a_worker.call("check", s.ak, [(LOCAL, 34)])
    assert s.p_worker.call("wait_freed", s.pk, ["r1"], WAIT_S) == ["r1"]
    t2 = hold_everywhere(s.producers, "r2", LAYOUT, seed=35)  # the same blocks, other bytes
    s.b_link()
    s.b_worker.call("call", decline, s.bk, t1)
    for kind in wire.CompletionKind:
        s.b_raw(wire.decode_ticket(t1), kind)
    s.b_worker.call("call", read_then_abort, s.bk, t1, B_LOCAL.block_ids, 20)  # claim answered ENDED
    _until("B's late reports", lambda: s.p_status()["stats"]["unknown_request"] >= 2 + len(wire.CompletionKind))
    s.p_worker.call("settle", 0.1)
    st = s.p_status(["r2"])
    assert st["holds"] == {"r2": "held"} and st["pinned_blocks"] == 5 and st["terminal"] == {"freed": 1}, st
    s.a_worker.call("start_read", s.ak, t2, LOCAL.block_ids, 20)
    result = s.a_worker.call("call", wait_results, s.ak, ["r2"], WAIT_S)["r2"]
    assert result is not None and result["state"] == "done", result
    s.a_worker.call("check", s.ak, [(LOCAL, 35)])
    assert s.p_worker.call("wait_freed", s.pk, ["r2"], WAIT_S) == ["r2"]
