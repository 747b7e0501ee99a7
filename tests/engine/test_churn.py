"""1,000 requests with aborts at random moments on both sides (real NIXL, 4 processes, loopback DRAM).

Two producer engines (A: TP1; B: TP2 over two processes) and two consumer engines (X: TP1; Y: TP2),
every pair in use: 1->1, 1->2 fan-out, 2->1 fan-in, 2->2. Requests run in batches; in each, the
embedder side of every rank (lifecycle_ops.ChurnProducer / ChurnConsumer) aborts requests after a
random number of its own polls, or right after the hold or start_read, while the other processes
run on: the moments are random in wall time too. A consumer checks every DONE request's blocks
against the global oracle the moment it is reported, then poisons them for reuse; blocks go back
to the test's free pools only once reported (consumer) or released (producer), so a wrong free
shows up as a wrong byte in a later request.

Afterwards: zero blocks pinned on producers, zero quarantined on consumers, zero NIXL handles
alive anywhere, every DONE request verified, every request in exactly one terminal state per rank.
"""

from __future__ import annotations

import collections
import math
import random

from harness import TINY, RankSpec, hold_everywhere, start_consumers, start_producers
from lifecycle_ops import churn_final, churn_hold, churn_read, churn_wait, churn_wrap

from hybrid_transfer.engine import EngineConfig, decode_ticket
from hybrid_transfer.verify import RequestLayout

NUM_REQUESTS = 1000
BATCH = 50
NUM_BLOCKS = 256
BLOCK_SIZE = 16  # the tiny model's block size at TP1 and TP2
TOKEN_COUNTS = [0, 1, 15, 16, 17, 31, 40, 64]
ABORT_MOMENTS = [-1, 0, 0, 1, 2, 3, 5, 8]  # polls of the aborting side after hold / start_read; -1: at once
WAIT_S = 60.0
assert hold_everywhere  # the same ticket rule as harness.hold_everywhere: rank 0 draws, the others follow


_REPORTED = {  # stats summed over ranks for the summary line
    "producer_stats": ("completions", "completions_aborted", "completions_failed", "revokes_sent", "acks",
                       "stale_acks", "renewals", "stale_heartbeats", "unknown_request", "malformed"),
    "consumer_stats": ("reads_posted", "revokes", "heartbeats_sent", "notify_failures", "unexpected_notifications"),
}


class Engine:
    """One engine's ranks as (worker, key) and the test's free pool of its block ids."""

    def __init__(self, ranks, tp_size: int):
        self.workers, self.keys = ranks.workers, ranks.keys
        self.tp_size = tp_size
        self.free = list(range(NUM_BLOCKS))

    def allocate(self, rng: random.Random, num_tokens: int, extra: int) -> RequestLayout:
        need = math.ceil(num_tokens / BLOCK_SIZE) + extra
        ids = rng.sample(self.free, need + 3)
        for b in ids:
            self.free.remove(b)
        return RequestLayout((tuple(ids[:need]), (ids[need],), (ids[need + 1],), (ids[need + 2],)), num_tokens)

    def give_back(self, layout: RequestLayout) -> None:
        self.free.extend(b for group in layout.block_ids for b in group)


def _send(worker, func, *args):
    worker.conn.send(("call", (func, *args)))


def _recv(worker):
    assert worker.conn.poll(WAIT_S * 2), f"{worker.process.name} did not answer"
    status, value = worker.conn.recv()
    assert status == "ok", value
    return value


def _gather(calls):
    """Send every (worker, func, args) at once (each worker runs its own in order), then collect in order."""
    for worker, func, *args in calls:
        _send(worker, func, *args)
    return [_recv(worker) for worker, *_ in calls]


def test_aborts_at_random_moments_leave_nothing_pinned_quarantined_or_alive(cluster):
    p0, p1, c0, c1 = cluster.workers[:4]
    p_config = EngineConfig(lease_s=20.0)
    c_config = EngineConfig(lease_s=20.0, heartbeat_interval_s=0.2, read_deadline_s=30.0)
    a = start_producers([p0], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], p_config)
    b = start_producers([p0, p1], [RankSpec(TINY, 2, r, NUM_BLOCKS) for r in range(2)], p_config)
    x = start_consumers([c1], [RankSpec(TINY, 1, 0, NUM_BLOCKS)], c_config)
    y = start_consumers([c0, c1], [RankSpec(TINY, 2, r, NUM_BLOCKS) for r in range(2)], c_config)
    engines = {"A": Engine(a, 1), "B": Engine(b, 2), "X": Engine(x, 1), "Y": Engine(y, 2)}
    ranks = [(w, k) for e in engines.values() for w, k in zip(e.workers, e.keys, strict=True)]
    try:
        for consumer in (x, y):
            for w, k in zip(consumer.workers, consumer.keys, strict=True):
                for producer in (a, b):
                    w.call("connect", k, producer.addresses[0], 10.0)
        for w, k in ranks:
            w.call("call", churn_wrap, k)
        rng = random.Random(20261129)
        counts: collections.Counter = collections.Counter()
        per_rank: dict[str, int] = collections.Counter()
        for start in range(0, NUM_REQUESTS, BATCH):
            _batch(engines, rng, range(start, min(start + BATCH, NUM_REQUESTS)), counts, per_rank)
        finals = _gather([(w, churn_final, k, 0.5) for w, k in ranks])
        summary = {"requests": NUM_REQUESTS, "outcomes": dict(sorted(counts.items())),
                   "producer_terminal": {}, "consumer_terminal": {}}
        for (_, k), final in zip(ranks, finals, strict=True):
            assert final["live_handles"] == 0, (k, final)
            assert final["pending_aborts"] == 0, (k, final)
            terminal = final["terminal"]
            assert sum(terminal.values()) == per_rank[k], (k, terminal, per_rank[k])
            if "pinned_blocks" in final:
                assert (final["pinned_blocks"], final["held_requests"]) == (0, 0), (k, final)
                assert final["releases"] == final["distinct_released"] == per_rank[k], (k, final)
                bucket = summary["producer_terminal"]
            else:
                assert (final["quarantined_blocks"], final["active"]) == (0, 0), (k, final)
                assert final["raised"] == {}, (k, final)
                bucket = summary["consumer_terminal"]
            for state, n in terminal.items():
                bucket[state] = bucket.get(state, 0) + n
            side = "producer_stats" if "pinned_blocks" in final else "consumer_stats"
            for name in _REPORTED[side]:
                summary.setdefault(side, {}).setdefault(name, 0)
                summary[side][name] += final["stats"][name]
        print("churn summary:", summary)  # the closing note quotes these counts
        assert counts["done/verified"] > 0 and counts["done/WRONG BYTES"] == 0
        assert sum(summary["producer_terminal"].values()) == sum(per_rank[k] for k in a.keys + b.keys)
    finally:
        for engine in (x, y, a, b):
            engine.close()


def _batch(engines, rng: random.Random, indices, counts, per_rank) -> None:
    items = []
    for i in indices:
        p, c = rng.choice("AB"), rng.choice("XY")
        num_tokens = rng.choice(TOKEN_COUNTS)
        fate = rng.random()
        p_abort = rng.choice(ABORT_MOMENTS) if 0.45 <= fate < 0.70 or fate >= 0.92 else None
        c_abort = rng.choice(ABORT_MOMENTS) if fate >= 0.70 else None
        remote = engines[p].allocate(rng, num_tokens, extra=0)
        local = engines[c].allocate(rng, num_tokens, extra=rng.choice([0, 1]))
        items.append((f"req-{i}", p, c, remote, local, 7000 + i, p_abort, c_abort))
    # Holds: rank 0 of each producer engine draws the nonces, the other ranks follow (as hold_everywhere).
    tickets = {}
    for name in "AB":
        engine, mine = engines[name], [it for it in items if it[1] == name]
        if not mine:
            continue
        first = engine.workers[0].call("call", churn_hold, engine.keys[0],
                                       [(rid, remote, seed, None, pa) for rid, _, _, remote, _, seed, pa, _ in mine])
        nonces = [decode_ticket(t).nonce for t in first]
        for w, k in zip(engine.workers[1:], engine.keys[1:], strict=True):
            w.call("call", churn_hold, k, [(it[0], it[3], it[5], n, it[6]) for it, n in zip(mine, nonces, strict=True)])
        tickets |= {it[0]: t for it, t in zip(mine, first, strict=True)}
    # Reads on every consumer rank at once, while the producers run their aborts.
    calls = []
    for name in "XY":
        engine, mine = engines[name], [it for it in items if it[2] == name]
        for w, k in zip(engine.workers, engine.keys, strict=True):
            calls.append((w, churn_read, k, [(tickets[it[0]], it[4], it[5], it[7]) for it in mine]))
    _gather(calls)
    # Every rank until it has finished with each of its requests.
    waits = []
    for name, engine in engines.items():
        is_producer = name in "AB"
        mine = [it[0] for it in items if it[1 if is_producer else 2] == name]
        for w, k in zip(engine.workers, engine.keys, strict=True):
            waits.append((k, is_producer, (w, churn_wait, k, mine, WAIT_S)))
            per_rank[k] += len(mine)
    for (key, is_producer, _), seen in zip(waits, _gather([call for *_, call in waits]), strict=True):
        for rid, outcome in seen.items():
            if is_producer:
                assert outcome == 1, (key, rid, outcome)  # released exactly once
                continue
            assert len(outcome) == 1, (key, rid, outcome)  # reported exactly once
            state, cause, verified = outcome[0]
            assert state in ("done", "failed", "aborted"), (key, rid, outcome)
            label = "done/" + ("verified" if verified else "WRONG BYTES") if state == "done" else f"{state}/{cause}"
            counts[label] += 1
            assert state != "done" or verified, (key, rid, outcome)
    for _, p, c, remote, local, *_ in items:
        engines[p].give_back(remote)
        engines[c].give_back(local)
