"""Reads batched per step (engine/read_batch.py) with real NIXL agents (UCX, loopback DRAM, separate processes).

Each case runs a step of several requests through ``Consumer.start_reads``: batched ("per_step", one READ
and one Claims per producer agent) against today's path ("per_request"), a handle that real NIXL refuses,
and an abort while the shared READ is in flight (the producer's polling paused: on this host a loopback
READ completes only once its target is progressed, tests/engine/test_lifecycle_nixl.py).
"""

from __future__ import annotations

import time

import pytest
from batch_ops import agent_name, cache_digest, corrupt_reads_from, read_stats, start_reads
from harness import TINY, RankSpec, hold_everywhere, start_consumers, start_producers
from lifecycle_ops import abort, pause, resume, status, wait_results

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.verify import RequestLayout

WAIT_S = 30.0
NUM_BLOCKS = 32
TOKENS = (20, 17, 32, 29)  # block size 16: two attention blocks each, tails of every length


def _layout(i: int, base: int) -> RequestLayout:
    b = base + 5 * i
    return RequestLayout(((b, b + 1), (b + 2,), (b + 3,), (b + 4,)), TOKENS[i % len(TOKENS)])


def _until(check, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)
    return value


def _connect(c_worker, ck, producers_list):
    for producers in producers_list:
        c_worker.call("connect", ck, producers.addresses[0], 10.0)
    n = sum(len(p.keys) for p in producers_list)
    _until(lambda: c_worker.call("call", status, ck)["stats"]["welcomes"] == n)


def _step(producers, c_worker, ck, names, first=0):
    """Hold ``names`` on ``producers`` (request i at remote blocks 5i.., local blocks 5i+1..) and return the items."""
    items, layouts = [], []
    for i, rid in enumerate(names, start=first):
        remote = _layout(i, 0)
        ticket = hold_everywhere(producers, rid, remote, seed=100 + i)
        local = _layout(i, 1)
        items.append((ticket, local.block_ids, local.num_tokens))
        layouts.append((local, 100 + i))
    return items, layouts


@pytest.mark.parametrize("mode", [PlanMode.COALESCED, PlanMode.PACK])
@pytest.mark.parametrize("tp", [1, 2])
def test_batched_and_per_request_calls_move_identical_verified_bytes(cluster, tp, mode):
    """P<tp> -> D1, four requests in one step: both settings verify every byte and leave identical caches;
    per_step posts one READ per producer agent (pack: of the four staged ranges, their Staged notifications
    already in), per_request one per request and agent. Claims: one entry per request and agent either way."""
    workers = cluster.workers
    names = [f"r{i}" for i in range(4)]
    digests, stats = {}, {}
    for batching in ("per_step", "per_request"):
        producers = start_producers(workers[:tp], [RankSpec(TINY, tp, r, NUM_BLOCKS) for r in range(tp)],
                                    EngineConfig(mode=mode, staging_bytes=1 << 20))
        consumers = start_consumers([workers[tp]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)],
                                    EngineConfig(read_batching=batching, mode=mode, staging_bytes=1 << 20))
        c_worker, ck = workers[tp], consumers.keys[0]
        try:
            _connect(c_worker, ck, [producers])
            items, layouts = _step(producers, c_worker, ck, names)
            c_worker.call("settle", 0.2)  # pack: every Staged notification is in before the step
            assert c_worker.call("call", start_reads, ck, items) == [None] * 4
            results = c_worker.call("call", wait_results, ck, names, WAIT_S)
            assert {rid: r["state"] for rid, r in results.items()} == dict.fromkeys(names, "done")
            c_worker.call("check", ck, layouts)  # every byte of the cache: moved ones and poison elsewhere
            digests[batching] = c_worker.call("call", cache_digest, ck)
            stats[batching] = c_worker.call("call", read_stats, ck)
            for w, k in zip(producers.workers, producers.keys, strict=True):
                assert w.call("wait_freed", k, names, WAIT_S) == sorted(names)
        finally:
            consumers.close()
            producers.close()
    assert digests["per_step"] == digests["per_request"]
    step, alone = stats["per_step"], stats["per_request"]
    assert step["claims_sent"] == alone["claims_sent"] == 4 * tp
    if mode is PlanMode.PACK:  # every source staged: its READs are the pack reader's
        assert step["packed_sources"] == alone["packed_sources"] == 4 * tp
        assert (step["staged_reads"], alone["staged_reads"]) == (tp, 4 * tp)
        assert step["reads_posted"] == alone["reads_posted"] == 0
    else:
        assert (step["reads_posted"], alone["reads_posted"]) == (tp, 4 * tp)


def test_a_failed_handle_fails_exactly_its_requests(cluster):
    """Two producer engines, two requests each, one step: real NIXL refuses the READ to engine A (remote
    addresses outside its memory). A's two requests fail with cause nixl; B's two are DONE and verified."""
    workers = cluster.workers
    a = start_producers([workers[0]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    b = start_producers([workers[1]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    consumers = start_consumers([workers[2]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], EngineConfig())
    c_worker, ck = workers[2], consumers.keys[0]
    try:
        _connect(c_worker, ck, [a, b])
        items_a, _ = _step(a, c_worker, ck, ["a0", "a1"])
        items_b, layouts_b = _step(b, c_worker, ck, ["b2", "b3"], first=2)
        c_worker.call("call", corrupt_reads_from, ck, workers[0].call("call", agent_name, a.keys[0]))
        assert c_worker.call("call", start_reads, ck, items_a + items_b) == [None] * 4
        results = c_worker.call("call", wait_results, ck, ["a0", "a1", "b2", "b3"], WAIT_S)
        assert {rid: (r["state"], r["cause"]) for rid, r in results.items()} == {
            "a0": ("failed", "nixl"), "a1": ("failed", "nixl"), "b2": ("done", None), "b3": ("done", None)}
        c_worker.call("check", ck, layouts_b)  # B's bytes in place; A's blocks and the rest still poison
        st = c_worker.call("call", read_stats, ck)
        assert (st["live_handles"], st["quarantined_blocks"]) == (0, 0)
        assert workers[0].call("wait_freed", a.keys[0], ["a0", "a1"], WAIT_S) == ["a0", "a1"]  # told FAILED
        assert workers[1].call("wait_freed", b.keys[0], ["b2", "b3"], WAIT_S) == ["b2", "b3"]
    finally:
        consumers.close()
        a.close()
        b.close()


def test_an_aborted_requests_blocks_stay_quarantined_until_its_shared_handle_is_terminal(cluster):
    """Two requests share one READ held in flight; the first is aborted: it is not reported, and its blocks
    stay quarantined, while the READ its neighbour shares is in flight. Once the producer is progressed the
    neighbour is DONE (verified), the shared handle is released, and only then is the abort reported."""
    workers = cluster.workers
    producers = start_producers([workers[0]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    consumers = start_consumers([workers[1]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], EngineConfig(read_deadline_s=60))
    p_worker, pk, c_worker, ck = workers[0], producers.keys[0], workers[1], consumers.keys[0]
    paused = False
    try:
        _connect(c_worker, ck, [producers])
        items, layouts = _step(producers, c_worker, ck, ["x", "y"])
        p_worker.call("call", pause, pk)
        paused = True
        assert c_worker.call("call", start_reads, ck, items) == [None, None]
        c_worker.call("settle", 0.1)
        st = c_worker.call("call", read_stats, ck)
        assert st["states"] == {"x": "reading", "y": "reading"} and st["shared"] == {"x": [True], "y": [True]}
        assert st["reads_posted"] == 1 and st["live_handles"] == 1  # one READ for the step
        assert c_worker.call("call", abort, ck, "x")
        assert c_worker.call("call", wait_results, ck, ["x"], 0.3) == {"x": None}  # the shared READ is in flight
        st = c_worker.call("call", read_stats, ck)
        assert st["states"] == {"x": "aborting", "y": "reading"}
        assert st["quarantined_blocks"] == sum(len(g) for g in layouts[0][0].block_ids)
        p_worker.call("call", resume, pk)
        paused = False
        results = c_worker.call("call", wait_results, ck, ["y", "x"], WAIT_S)
        assert (results["y"]["state"], results["x"]["state"]) == ("done", "aborted")
        # y's bytes in place; the shared READ completed, so x's landed in its blocks while they were quarantined.
        c_worker.call("check", ck, layouts)
        st = c_worker.call("call", read_stats, ck)
        assert (st["live_handles"], st["quarantined_blocks"], st["states"]) == (0, 0, {})
        assert p_worker.call("wait_freed", pk, ["x", "y"], WAIT_S) == ["x", "y"]
    finally:
        if paused:
            p_worker.call("call", resume, pk)
        consumers.close()
        producers.close()


def test_a_batched_report_counts_only_from_the_agent_whose_claim_was_confirmed(cluster):
    """P1 -> D2: decode rank 0 reads through start_reads (one Claims, one Completions). Another linked agent's
    Completions speaking for rank 0 is not counted (rank 0's claim was confirmed for rank 0's agent): the hold
    waits for rank 1's own batched read, which frees it."""
    from harness import raw_notify

    from hybrid_transfer.engine import decode_ticket, wire

    workers = cluster.workers
    producers = start_producers([workers[0]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    decode = start_consumers(workers[1:3], [RankSpec(TINY, 2, r, NUM_BLOCKS) for r in range(2)])
    stranger = start_consumers([workers[3]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    p_worker, pk = workers[0], producers.keys[0]
    try:
        for w, k in [*zip(decode.workers, decode.keys, strict=True), (workers[3], stranger.keys[0])]:
            _connect(w, k, [producers])
        remote, local = _layout(0, 0), _layout(0, 1)
        ticket = hold_everywhere(producers, "r", remote, seed=7)
        item = (ticket, local.block_ids, local.num_tokens)
        w0, k0 = decode.workers[0], decode.keys[0]
        assert w0.call("call", start_reads, k0, [item]) == [None]
        assert w0.call("call", wait_results, k0, ["r"], WAIT_S)["r"]["state"] == "done"
        w0.call("settle", 0.2)
        forged = wire.Completions(consumer_rank=0, entries=(wire.CompletionEntry(
            "r", decode_ticket(ticket).nonce, 2, wire.CompletionKind.DONE),))
        digest = p_worker.call("producer_status", pk)["digest"]
        p_agent = p_worker.call("call", agent_name, pk)
        workers[3].call("call", raw_notify, stranger.keys[0], p_agent, wire.encode(forged, digest))
        _until(lambda: p_worker.call("producer_status", pk)["stats"]["not_reader"] == 1)
        st = p_worker.call("producer_status", pk, ["r"])
        assert st["held"] == ["r"] and st["stats"]["completions"] == 1 and st["stats"]["claims_confirmed"] == 1
        w1, k1 = decode.workers[1], decode.keys[1]
        assert w1.call("call", start_reads, k1, [item]) == [None]
        assert w1.call("call", wait_results, k1, ["r"], WAIT_S)["r"]["state"] == "done"
        assert p_worker.call("wait_freed", pk, ["r"], WAIT_S) == ["r"]
        st = p_worker.call("producer_status", pk)["stats"]
        assert (st["completions"], st["claims_confirmed"], st["not_reader"]) == (2, 2, 1)
    finally:
        stranger.close()
        decode.close()
        producers.close()


def test_a_refused_claim_fails_only_its_own_request_of_the_shared_read(cluster):
    """Engine D1 reads r (DONE, the producer frees it). Engine D2 then reads r and s in one step: one READ,
    one Claims. The producer answers r ENDED and s CONFIRMED in one ClaimReplies: r fails (ticket_replayed)
    and reports nothing, s is DONE with verified bytes from the same shared READ."""
    workers = cluster.workers
    producers = start_producers([workers[0]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    first = start_consumers([workers[1]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    second = start_consumers([workers[2]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)])
    p_worker, pk = workers[0], producers.keys[0]
    w1, k1, w2, k2 = workers[1], first.keys[0], workers[2], second.keys[0]
    try:
        _connect(w1, k1, [producers])
        _connect(w2, k2, [producers])
        items, layouts = _step(producers, w1, k1, ["r", "s"])
        assert w1.call("call", start_reads, k1, items[:1]) == [None]
        assert w1.call("call", wait_results, k1, ["r"], WAIT_S)["r"]["state"] == "done"
        assert p_worker.call("wait_freed", pk, ["r"], WAIT_S) == ["r"]
        assert w2.call("call", start_reads, k2, items) == [None, None]
        results = w2.call("call", wait_results, k2, ["r", "s"], WAIT_S)
        assert {rid: (r["state"], r["cause"]) for rid, r in results.items()} == {
            "r": ("failed", "ticket_replayed"), "s": ("done", None)}
        st = w2.call("call", read_stats, k2)
        assert (st["reads_posted"], st["claims_sent"], st["live_handles"], st["quarantined_blocks"]) == (1, 2, 0, 0)
        w2.call("check", k2, layouts)  # s verified; the shared READ also filled r's blocks before they were let go
        assert p_worker.call("wait_freed", pk, ["s"], WAIT_S) == ["s"]
        stats = p_worker.call("producer_status", pk)["stats"]
        assert (stats["claims_confirmed"], stats["claims_refused"], stats["completions"]) == (2, 1, 2)
    finally:
        second.close()
        first.close()
        producers.close()


def test_a_step_planned_in_one_pass_fails_each_bad_request_alone_with_start_reads_own_error(cluster):
    """One start_reads call plans its ready requests in one pass (Planner.plan_many, vectorized id checks):
    a local id out of range, a block another request of the same step already owns, and a request id listed
    twice each fail alone with the typed error start_read raises; the good requests move verified bytes."""
    workers = cluster.workers
    producers = start_producers(workers[:1], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], EngineConfig())
    consumers = start_consumers([workers[1]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], EngineConfig())
    c_worker, ck = workers[1], consumers.keys[0]
    try:
        _connect(c_worker, ck, [producers])
        items, layouts = _step(producers, c_worker, ck, ["g0", "bad_id", "busy", "g3"])
        ticket, local, esp = items[1]
        items[1] = (ticket, (local[0], (NUM_BLOCKS + 7,), *local[2:]), esp)  # beyond the local cache
        ticket, local, esp = items[2]
        items[2] = (ticket, (local[0], items[0][1][1], *local[2:]), esp)  # g0's first state block
        items.append(items[0])  # g0 again, in the same step
        errors = c_worker.call("call", start_reads, ck, items)
        assert errors == [None, "BlockIdError", "BlockBusyError", None, "RequestStateError"]
        results = c_worker.call("call", wait_results, ck, ["g0", "g3"], WAIT_S)
        assert {rid: r["state"] for rid, r in results.items()} == {"g0": "done", "g3": "done"}
        c_worker.call("check", ck, [layouts[0], layouts[3]])
    finally:
        consumers.close()
        producers.close()


def test_a_batched_step_posted_by_the_posting_thread_moves_the_same_verified_bytes(cluster):
    """per_step with ``post_thread`` on: the step's one READ is handed to the posting thread (engine/poster.py)
    and its requests still finish DONE with every byte verified, one READ posted for the step."""
    workers = cluster.workers
    names = [f"t{i}" for i in range(4)]
    producers = start_producers(workers[:1], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], EngineConfig())
    consumers = start_consumers([workers[1]], [RankSpec(TINY, 1, 0, NUM_BLOCKS)],
                                EngineConfig(read_batching="per_step", post_thread=True))
    c_worker, ck = workers[1], consumers.keys[0]
    try:
        _connect(c_worker, ck, [producers])
        items, layouts = _step(producers, c_worker, ck, names)
        assert c_worker.call("call", start_reads, ck, items) == [None] * 4
        results = c_worker.call("call", wait_results, ck, names, WAIT_S)
        assert {rid: r["state"] for rid, r in results.items()} == dict.fromkeys(names, "done")
        c_worker.call("check", ck, layouts)
        assert c_worker.call("call", read_stats, ck)["reads_posted"] == 1
    finally:
        consumers.close()
        producers.close()
