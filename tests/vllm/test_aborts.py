"""Aborts on either side, before and during the READ, through vLLM's schedulers and real NIXL.

"During" is reached on purpose: on this host a loopback READ completes only once the prefill
process is progressed, and nothing progresses a prefill rank but its engine's steps. The tests
stop stepping the prefill engine once the decode rank reports its READ in flight (NIXL state
PROC), abort, and only then let the prefill engine run again.

After every abort report the aborted request's decode blocks are hashed; they must not change
while both engines keep stepping (nothing writes after the report).
"""

from __future__ import annotations

from driver import Engine, run_until
from flows import drain, prefill, start_decode
from vllm.v1.request import RequestStatus

N = 100


def _engines(model_dir, hosts, *, p_extra=None, d_extra=None, **p_kwargs):
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True,
               extra=p_extra, **p_kwargs)
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False,
               extra=d_extra)
    return p, d


def _held(p: Engine) -> dict:
    return p.call("producer")


def _read_state(d: Engine) -> dict:
    return d.call("reads")


def test_prefill_abort_before_hand_off_frees_at_once(model_dir, hosts):
    """Aborted mid-prefill: no ticket, blocks back at once (vLLM cannot abort a request that already finished)."""
    p, d = _engines(model_dir, hosts, max_num_batched_tokens=32)  # chunked: 100 tokens take 4 steps
    try:
        request = p.add("p-abort", N, params={"do_remote_decode": True})
        p.step()
        assert 0 < request.num_computed_tokens < N - 1
        p.abort("p-abort")
        assert p.is_empty()
        outputs = p.step()
        assert "p-abort" not in outputs.finished_sending
        assert _held(p)["num_held_requests"] == 0
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_abort_before_scheduling_declines(model_dir, hosts):
    """The decode request ends before vLLM scheduled it: the producer hears a decline and frees at once."""
    p, d = _engines(model_dir, hosts)
    try:
        params = prefill(p, "p-dec", N)
        assert not p.is_empty()  # pinned for decode
        d.add("d-dec", N, params=params)
        d.abort("d-dec")  # before any decode step
        assert d.is_empty()
        drain((p, d), "the decline frees the prefill blocks")
        stats = p.call("call", _producer_stats)
        assert stats["terminal"].get("freed") == 1 and not stats["terminal"].get("expired")
        assert stats["completions_aborted"] == 1
    finally:
        p.shutdown()
        d.shutdown()


def _producer_stats(state, key):
    producer = state.ranks[key].connector._worker.producer
    return {"terminal": producer.terminal_counts, "completions_aborted": producer.stats.completions_aborted,
            "completions": producer.stats.completions}


def test_decode_abort_before_the_read(model_dir, hosts):
    """Ordered but not posted (the producer has not welcomed this consumer yet): aborted, nothing ever read."""
    p, d = _engines(model_dir, hosts)
    try:
        params = prefill(p, "p-early", N)
        start_decode(d, "d-early", N, params)
        for _ in range(3):
            d.step()  # the prefill engine is not stepped: its Welcome never comes, no READ is posted
        reads = _read_state(d)
        assert [(s, h) for s, h in reads.values()] == [("waiting_peer", [])]
        layout = d.layout("d-early", N - 1)
        before = d.call("digest", layout)
        d.abort("d-early")
        assert not d.is_empty()  # vLLM keeps WAITING_FOR_REMOTE_KVS blocks until the worker reports
        run_until("decode reports the abort", d.is_empty, [d])
        assert d.call("digest", layout) == before
        drain((p, d), "the producer hears the abort")
        assert d.call("digest", layout) == before
        assert p.call("call", _producer_stats)["completions_aborted"] == 1
    finally:
        p.shutdown()
        d.shutdown()


def test_decode_abort_during_the_read(model_dir, hosts):
    """Aborted while NIXL reports the READ in flight: reported only once nothing can write, then never written."""
    p, d = _engines(model_dir, hosts)
    try:
        params = prefill(p, "p-mid", N)
        start_decode(d, "d-mid", N, params)
        run_until("the READ is in flight", lambda: list(_read_state(d).values()) == [("reading", ["PROC"])], [p, d])
        for _ in range(3):  # still in flight: nothing progresses the prefill rank
            d.step()
        assert list(_read_state(d).values()) == [("reading", ["PROC"])]
        assert d.status("d-mid") is RequestStatus.WAITING_FOR_REMOTE_KVS
        layout = d.layout("d-mid", N - 1)
        d.abort("d-mid")
        reported = []

        def note(engine, result):
            if engine is d and "d-mid" in result.finished_recving:
                reported.append(d.call("digest", layout))

        # Decode first: it reports once NIXL has let go of the READ (cancelled, or completed once
        # the prefill rank is progressed again); vLLM keeps the blocks until then.
        run_until("decode reports the abort", lambda: bool(reported), [d, p], on_step=note)
        drain((p, d), "everything freed")
        assert d.call("digest", layout) == reported[0]
        assert p.call("call", _producer_stats)["terminal"].get("freed") == 1
    finally:
        p.shutdown()
        d.shutdown()
