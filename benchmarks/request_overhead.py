"""The consumer's own Python work per direct-path request, with NIXL's calls timed apart.

One spawned process per producer rank and one for the measured consumer (decode rank 0), loopback,
default EngineConfig (coalesced plans, DIRECT descriptors). Inside the consumer, every call into the
NIXL agent (descriptor lists, initialize_xfer, transfer, check_xfer_state, release, notifications) is
timed by a wrapper (hybrid_transfer/bench/hooks.py); the consumer's Python work is the rest:

  start_read   the call (plan, validation, post), and of it: NIXL, the planner (plan), the Python inside
               _post less NIXL (post: descriptor lists, handles, the claim) and the rest less NIXL (checks:
               ticket and id checks, block ownership, the MAC)
  done poll    the poll() that reported the request DONE (check, release, notify), and of it: NIXL
  polls        every poll() between post and DONE (their count, their Python work summed)
  python       start_read + every poll of the request, minus NIXL: the per-request CPU cost the engine
               itself adds (issue 13's target: well under 0.3 ms)

Each repetition holds the same blocks under a new request id, reads them, and waits for the free.
Medians over --reps (a first read per layout warms up).

With ``--batch N`` (issue 20, docs/lifecycle.md#batched-reads) each repetition is one engine step of N
requests started by one ``Consumer.start_reads`` call, under both ``read_batching`` settings
("per_step": one READ and one Claims per producer agent; "per_request": each request alone). Its rows
give the worker-thread wall time per request (the start_reads call plus every poll until all N are
DONE, divided by N), NIXL's share of it and the Python rest, the READs posted per step, the descriptors
per request (mean over the step) and the poll() calls until all N were DONE. ``--engines E`` spreads
each step over E producer engines (each its own engine_id, incarnation, rank processes and caches;
request i from engine i % E) that the decode rank links to, still one start_reads call per step; the
E engines' ranks poll E times less often when idle, so the fleet polls at one engine's rate. Every
step's bytes are verified: the producers hold hybrid_transfer.verify's pattern, the decode rank's cache
is poisoned before the step and compared after it (outside the timed calls). The caches' sizes are
printed first; ``--mem-budget-gib`` (120) bounds them.

Run: python benchmarks/request_overhead.py [--case p1d1|p2d8|small|all] [--device cpu|cuda] [--reps 20]
     python benchmarks/request_overhead.py --case p1d1 --batch 16 [--reps 10]
     python benchmarks/request_overhead.py --case p1d1 --batch 16 --engines 8 [--reps 3] [--mem-budget-gib 120]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _ranks import (
    answer,
    fill_engines,
    hold_everywhere,
    serve_holds,
    spawn,
    start_engines,
    start_producers,
    stop_producers,
)
from _ranks import blocks_for as _blocks_for
from _ranks import device as _device
from _ranks import geometry as _geometry

CASES = {
    "small": {"preset": "qwen3.5-0.8b", "prefill_tp": 1, "decode_tp": 1, "tokens": 2048},
    "p1d1": {"preset": "qwen3.5-397b-a17b", "prefill_tp": 1, "decode_tp": 1, "tokens": 8192},
    "p2d8": {"preset": "qwen3.5-397b-a17b", "prefill_tp": 2, "decode_tp": 8, "tokens": 8192},
}


TRANSPORT_ENV = "HT_OVERHEAD_READ_TRANSPORT"  # --read-transport, for the spawned rank processes
IDLE_SLEEP_S = 0.0001  # a producer rank's sleep between polls when one engine serves the consumer


def _producer(conn, preset, tp_size, rank, num_blocks, device, engine_id="overhead", incarnation=1,
              sleep_s=IDLE_SLEEP_S) -> None:
    from hybrid_transfer import HybridCache, Producer

    shared = device == "cpu" and os.environ.get(TRANSPORT_ENV, "nixl") != "nixl"  # mappable (--read-transport)
    producer = Producer(HybridCache.allocate(_geometry(preset, tp_size, rank), num_blocks, _device(device),
                                             shared=shared), engine_id=engine_id, incarnation=incarnation)
    serve_holds(conn, producer, tp_size, hold=_hold, sleep_s=sleep_s)


def _hold(producer, request_id, block_ids, tokens, nonce, wait_s: float = 30.0):
    """Hold, polling while the held-block cap is reached (the last step's holds free once their completions
    are in)."""
    from hybrid_transfer.errors import HoldCapacityError

    deadline = time.monotonic() + wait_s
    while True:
        try:
            return producer.hold(request_id, block_ids, tokens, nonce=nonce)
        except HoldCapacityError:
            if time.monotonic() > deadline:
                raise
            producer.poll()
            time.sleep(0.0005)


def _consumer(conn, preset, decode_tp, num_blocks, tokens, reps, device, profile) -> None:
    import cProfile
    import pstats

    from hybrid_transfer import Consumer, HybridCache
    from hybrid_transfer.bench.hooks import time_nixl_calls
    from hybrid_transfer.verify import make_request

    geometry = _geometry(preset, decode_tp, 0)
    consumer = Consumer(HybridCache.allocate(geometry, num_blocks, _device(device)))
    timed = time_nixl_calls(consumer)  # NIXL's data-path calls on this thread, timed into timed.spent
    plan_s = [0.0]
    plan = consumer._plan

    def timed_plan(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return plan(*args, **kwargs)
        finally:
            plan_s[0] += time.perf_counter() - t0

    consumer._plan = timed_plan
    post_s = [0.0]  # Python inside _post (NIXL's calls taken out): descriptor lists, handles, the claim
    post = consumer._post

    def timed_post(*args, **kwargs):
        t0, nixl0 = time.perf_counter(), timed.spent
        try:
            return post(*args, **kwargs)
        finally:
            post_s[0] += time.perf_counter() - t0 - (timed.spent - nixl0)

    consumer._post = timed_post
    consumer.connect(conn.recv())
    profiler = cProfile.Profile() if profile else None
    rows = []
    for frag in (0.0, 1.0):
        local = make_request(geometry, tokens, num_blocks, rng=7, fragmentation=frag)
        samples = []
        for i in range(reps + 1):
            ticket = conn.recv()
            timed.spent, plan_s[0], post_s[0] = 0.0, 0.0, 0.0
            if profiler is not None and i:
                profiler.enable()
            t0 = time.perf_counter()
            consumer.start_read(ticket, local.block_ids, expected_state_position=tokens)
            start_s, start_nixl, start_plan, start_post = time.perf_counter() - t0, timed.spent, plan_s[0], post_s[0]
            polls, poll_py, results = 0, 0.0, []
            while not results:
                timed.spent = 0.0
                p0 = time.perf_counter()
                results = consumer.poll()
                p_s = time.perf_counter() - p0
                polls += 1
                poll_py += p_s - timed.spent
            if profiler is not None:
                profiler.disable()
            if not results[0].ok:
                raise RuntimeError(f"read failed: {results[0].error}")
            if i:  # the first read of each layout warms up
                samples.append({"start_ms": 1e3 * start_s, "start_nixl_ms": 1e3 * start_nixl,
                                "plan_ms": 1e3 * start_plan, "post_ms": 1e3 * start_post,
                                "checks_ms": 1e3 * (start_s - start_nixl - start_plan - start_post), "done_poll_ms": 1e3 * p_s,
                                "done_poll_nixl_ms": 1e3 * timed.spent, "polls": polls,
                                "python_ms": 1e3 * (start_s - start_nixl + poll_py)})
            conn.send("next")
        row = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        rows.append({"fragmentation": frag, "descriptors": results[0].num_descriptors, "bytes": results[0].num_bytes,
                     **row, "python_ms_max": max(s["python_ms"] for s in samples)})
    if profiler is not None:  # on stderr: where the Python work goes (profiling slows it down)
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(45)
        if os.environ.get("HT_OVERHEAD_PROFILE_OUT"):  # the whole profile, for pstats
            stats.dump_stats(f"{os.environ['HT_OVERHEAD_PROFILE_OUT']}.single")
    conn.send(rows)
    consumer.close()


def _seed(frag_index: int, slot: int) -> int:
    """The verify seed of a step's request ``slot`` under the ``frag_index``-th layout (distinct within a step)."""
    return 1 + 1000 * frag_index + slot


def _consumer_batch(conn, preset, decode_tp, num_blocks, tokens, reps, device, batch, batching,
                    profile=False) -> None:
    """One step of ``batch`` requests per repetition through start_reads; worker-thread time per request.

    Linked to every producer engine whose address it is sent. Every step's bytes are checked: the cache is
    poisoned before the step and compared after it with the expected bytes (hybrid_transfer.verify), both
    outside the timed calls.
    """
    import cProfile
    import pstats

    import torch

    from hybrid_transfer import Consumer, EngineConfig, HybridCache
    from hybrid_transfer.bench.hooks import time_nixl_calls
    from hybrid_transfer.engine.read_batch import Read
    from hybrid_transfer.verify import check_destination_many, expected_destination_many, make_requests, poison

    geometry = _geometry(preset, decode_tp, 0)
    cache = HybridCache.allocate(geometry, num_blocks, _device(device))
    consumer = Consumer(cache, EngineConfig(read_batching=batching,
                                            read_transport=os.environ.get(TRANSPORT_ENV, "nixl")))
    timed = time_nixl_calls(consumer)  # NIXL's data-path calls on this thread, timed into timed.spent
    copy_timer = _time_host_copies()  # the mapped path's copy on a CPU host runs inside the post: timed apart
    for address in conn.recv():  # rank 0 of each producer engine
        consumer.connect(address)
    profiler = cProfile.Profile() if profile else None
    rows = []
    for frag_index, frag in enumerate((0.0, 1.0)):
        locals_ = make_requests(geometry, [tokens] * batch, num_blocks, rng=7, fragmentation=frag)
        seeded = [(local, _seed(frag_index, i)) for i, local in enumerate(locals_)]
        expected = expected_destination_many(cache, seeded)
        samples = []
        for i in range(reps + 1):
            tickets = conn.recv()
            poison(cache)
            if cache.tensors[0].is_cuda:  # the poison lands before the READs (UCX's copies do not wait for it)
                torch.cuda.synchronize(cache.tensors[0].device)
            timed.spent = copy_timer.spent = 0.0
            posted0 = consumer.stats.reads_posted
            if profiler is not None and i:
                profiler.enable()
            t0 = time.perf_counter()
            errors = consumer.start_reads([Read(t, local.block_ids, tokens) for t, local in zip(tickets, locals_,
                                                                                               strict=True)])
            start_s = time.perf_counter() - t0
            if any(errors):
                raise RuntimeError(f"start_reads refused: {errors}")
            done, worker_s, polls = [], start_s, 0
            while len(done) < batch:
                p0 = time.perf_counter()
                done += consumer.poll()
                worker_s += time.perf_counter() - p0
                polls += 1
            if profiler is not None:
                profiler.disable()
            bad = [r for r in done if not r.ok]
            if bad:
                raise RuntimeError(f"read failed: {bad[0].error}")
            if not all(torch.equal(a, b) for a, b in zip(cache.tensors, expected, strict=True)):
                check_destination_many(cache, seeded)  # raises VerificationError naming the first bad byte
                raise RuntimeError("the cache differs from the expected bytes, but check_destination_many passed")
            if i:  # the first step of each layout warms up
                samples.append({"start_ms": 1e3 * start_s / batch, "worker_ms": 1e3 * worker_s / batch,
                                "nixl_ms": 1e3 * timed.spent / batch, "copy_ms": 1e3 * copy_timer.spent / batch,
                                "python_ms": 1e3 * (worker_s - timed.spent - copy_timer.spent) / batch,
                                "reads_per_step": consumer.stats.reads_posted - posted0, "polls": polls})
            conn.send("next")
        row = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
        rows.append({"fragmentation": frag, "batching": batching, "batch": batch,
                     "descriptors": statistics.mean(r.num_descriptors for r in done), "verified_steps": reps + 1, **row})
        del expected
    if profiler is not None:  # on stderr: where the worker thread's time goes (profiling slows it down)
        print(f"=== cProfile, read_batching={batching}", file=sys.stderr)
        stats = pstats.Stats(profiler, stream=sys.stderr)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(45)
        if os.environ.get("HT_OVERHEAD_PROFILE_OUT"):  # the whole profile, for pstats
            stats.dump_stats(f"{os.environ['HT_OVERHEAD_PROFILE_OUT']}.{batching}")
    conn.send(rows)
    consumer.close()


class _CopyTimer:
    spent = 0.0


def _time_host_copies() -> _CopyTimer:
    """Wrap the mapped path's host copy (engine/mapped/host_copy.py, called inside the post on a CPU host) so
    its wall time counts apart: on a GPU the copy is a kernel launch, here it is the copy itself."""
    from hybrid_transfer.engine.mapped import host_copy

    timer, copy = _CopyTimer(), host_copy.copy_ranges

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return copy(*args, **kwargs)
        finally:
            timer.spent += time.perf_counter() - t0

    host_copy.copy_ranges = timed
    return timer


def _shares(batch: int, engines: int) -> list[int]:
    """Requests per step from each engine: request i comes from engine i % engines."""
    return [len(range(e, batch, engines)) for e in range(engines)]


def _cache_bytes(preset: str, tp_size: int, num_blocks: int) -> int:
    """Bytes of one engine's caches: every rank's shared tensors at ``num_blocks`` pages."""
    return sum(num_blocks * g.page_bytes * g.num_tensors
               for g in (_geometry(preset, tp_size, rank) for rank in range(tp_size)))


def plan_memory(case: str, batch: int, engines: int, budget_gib: float) -> dict:
    """Block counts for run_batched and the memory they take on the device (every cache, both sides).

    Each engine's ranks get room for twice their share of a step's requests (the last step's holds may still
    be pinned when the next step's are held: _hold waits for them), and the consumer a step's requests plus
    the verify reference of the same size. Past ``budget_gib`` the producers get only what a step's holds
    need under the held-block cap; past it still, ConfigError.
    """
    from hybrid_transfer import EngineConfig
    from hybrid_transfer.errors import ConfigError

    c = CASES[case]
    preset, p_tp, d_tp, tokens = c["preset"], c["prefill_tp"], c["decode_tp"], c["tokens"]
    share = max(_shares(batch, engines))
    need_p = share * _blocks_for(_geometry(preset, p_tp, 0), tokens)
    d_geo = _geometry(preset, d_tp, 0)
    d_blocks = batch * _blocks_for(d_geo, tokens) + 2
    consumer_b = d_blocks * d_geo.page_bytes * d_geo.num_tensors  # the measured decode rank only
    cap = EngineConfig().held_blocks_cap
    tight = next(n for n in range(need_p, 2 * need_p + 3) if cap(n) >= need_p) + 2
    budget = int(budget_gib * 2**30)
    for p_blocks in (2 * need_p + 2, tight):
        producers_b = engines * _cache_bytes(preset, p_tp, p_blocks)
        total = producers_b + 2 * consumer_b
        if total <= budget:
            return {"p_blocks": p_blocks, "d_blocks": d_blocks, "producer_bytes": producers_b,
                    "consumer_bytes": consumer_b, "total_bytes": total, "budget_bytes": budget}
    raise ConfigError(f"{case}: {engines} engines x {batch} requests per step need {total / 2**30:.1f} GiB "
                      f"(producers {producers_b / 2**30:.1f}, consumer and its verify reference "
                      f"{2 * consumer_b / 2**30:.1f}) at the fewest blocks; the budget is {budget_gib} GiB",
                      field="mem_budget_gib", value=budget_gib)


def describe_memory(case: str, engines: int, mem: dict) -> str:
    c = CASES[case]
    gib = 2**30
    return (f"memory {case}: {engines} engine(s) x {c['prefill_tp']} rank(s) x {mem['p_blocks']} blocks = "
            f"{mem['producer_bytes'] / gib:.2f} GiB; decode rank {mem['d_blocks']} blocks = "
            f"{mem['consumer_bytes'] / gib:.2f} GiB (+ as much for the verify reference); "
            f"total {mem['total_bytes'] / gib:.2f} GiB of a {mem['budget_bytes'] / gib:.0f} GiB budget")


def run_batched(case: str, reps: int, device: str, batch: int, batching: str, engines: int = 1,
                mem: dict | None = None, profile: bool = False) -> list[dict]:
    """As run(), one step of ``batch`` requests per repetition (distinct blocks on both sides).

    ``engines`` producer engines (each its own engine_id and incarnation, its prefill_tp rank processes and
    caches); request i of a step comes from engine i % engines, and the one start_reads call takes them all.
    """
    from hybrid_transfer.verify import make_requests

    c = CASES[case]
    preset, p_tp, d_tp, tokens = c["preset"], c["prefill_tp"], c["decode_tp"], c["tokens"]
    p_geo = _geometry(preset, p_tp, 0)
    mem = mem or plan_memory(case, batch, engines, budget_gib=float("inf"))
    p_blocks, d_blocks = mem["p_blocks"], mem["d_blocks"]
    # The fleet polls at one engine's total rate: E idle ranks polling every 0.1 ms would take the 2-core CPU
    # host's cores from the measured rank (a READ's DONE needs nothing from the producers).
    sleep_s = IDLE_SLEEP_S * engines

    def rank_args(e: int, rank: int) -> tuple:
        engine_id = "overhead" if engines == 1 else f"overhead-{e}"
        return preset, p_tp, rank, p_blocks, device, engine_id, e + 1, sleep_s

    fleet, addresses = start_engines(_producer, engines, p_tp, rank_args)  # per engine: [(process, conn)] per rank
    consumer, c_parent = spawn(_consumer_batch, (preset, d_tp, d_blocks, tokens, reps, device, batch, batching,
                                                          profile))
    c_parent.send(addresses)

    shares = _shares(batch, engines)
    n = 0
    for frag_index, frag in enumerate((0.0, 1.0)):
        remotes = [make_requests(p_geo, [tokens] * shares[e], p_blocks, rng=3 + e, fragmentation=frag)
                   for e in range(engines)]
        fill_engines(fleet, [[(remote, _seed(frag_index, e + k * engines)) for k, remote in enumerate(remotes[e])]
                             for e in range(engines)])
        for _ in range(reps + 1):
            tickets = []
            for i in range(batch):
                n += 1
                e = i % engines
                tickets.append(hold_everywhere(fleet[e], f"req-{n}", remotes[e][i // engines].block_ids, tokens))
            c_parent.send(tickets)
            answer(c_parent, consumer)
    rows = answer(c_parent, consumer)
    consumer.join()
    for ranks in fleet:
        stop_producers(ranks)
    return [{"case": case, "device": device, "tokens": tokens, "engines": engines, **r} for r in rows]


def run(case: str, reps: int, device: str, profile: bool = False) -> list[dict]:
    c = CASES[case]
    preset, p_tp, d_tp, tokens = c["preset"], c["prefill_tp"], c["decode_tp"], c["tokens"]
    p_geo, d_geo = _geometry(preset, p_tp, 0), _geometry(preset, d_tp, 0)
    p_blocks, d_blocks = 2 * _blocks_for(p_geo, tokens) + 2, 2 * _blocks_for(d_geo, tokens) + 2
    producers, addresses = start_producers(_producer, p_tp, lambda rank: (preset, p_tp, rank, p_blocks, device))
    consumer, c_parent = spawn(_consumer, (preset, d_tp, d_blocks, tokens, reps, device, profile))
    c_parent.send(addresses[0])

    from hybrid_transfer.verify import make_request

    n = 0
    for frag in (0.0, 1.0):
        remote = make_request(p_geo, tokens, p_blocks, rng=3, fragmentation=frag)
        for _ in range(reps + 1):
            n += 1
            c_parent.send(hold_everywhere(producers, f"req-{n}", remote.block_ids, tokens))
            answer(c_parent, consumer)
    rows = answer(c_parent, consumer)
    consumer.join()
    stop_producers(producers)
    return [{"case": case, "device": device, "preset": preset, "prefill_tp": p_tp, "decode_tp": d_tp,
             "tokens": tokens, **r} for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--batch", type=int, default=1,
                        help="requests per step through start_reads, under both read_batching settings (1: start_read)")
    parser.add_argument("--engines", type=int, default=1,
                        help="with --batch: producer engines, request i of a step from engine i %% ENGINES (default 1)")
    parser.add_argument("--mem-budget-gib", type=float, default=120.0,
                        help="with --batch: every cache of the run (producers, decode rank, its verify reference) "
                             "must fit in this; past it the producers get fewer spare blocks (default 120)")
    parser.add_argument("--read-transport", choices=["nixl", "auto", "mapped"], default="nixl",
                        help="with --batch: the decode rank's EngineConfig.read_transport; auto or mapped give every "
                             "rank a fresh shared secret (the mapped path needs one); on a GPU the mapped copy "
                             "(a kernel launch) is then counted in the Python share, not NIXL's; on a CPU host the "
                             "copy runs inside the post and is its own column, copy (docs/tuning.md#mapped-reads)")
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per request instead of the case's (fewer bytes, the same kinds of "
                             "descriptors: quicker runs on a CPU host)")
    parser.add_argument("--profile", action="store_true", help="print the consumer's cProfile (by tottime, then cumulative) on stderr")
    args = parser.parse_args()
    if args.tokens is not None:
        if args.tokens < 2:
            parser.error("--tokens must be at least 2")
        for c in CASES.values():
            c["tokens"] = args.tokens
    if args.batch < 1:
        parser.error("--batch must be at least 1")
    if not 1 <= args.engines <= max(args.batch, 1) or (args.engines > 1 and args.batch == 1):
        parser.error("--engines must be between 1 and --batch, and needs --batch > 1")
    if args.device == "cuda":
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    os.environ[TRANSPORT_ENV] = args.read_transport
    if args.read_transport != "nixl":
        import secrets

        os.environ["HYBRID_TRANSFER_SECRET"] = secrets.token_hex(32)
    if args.batch > 1:
        cases = CASES if args.case == "all" else [args.case]
        rows = []
        for case in cases:
            mem = plan_memory(case, args.batch, args.engines, args.mem_budget_gib)
            print(describe_memory(case, args.engines, mem), file=sys.stderr if args.json else sys.stdout, flush=True)
            rows += [r for batching in ("per_step", "per_request")
                     for r in run_batched(case, args.reps, args.device, args.batch, batching, args.engines, mem,
                                             args.profile)]
        if args.json:
            print(json.dumps(rows, indent=1))
            return
        print(f"{'case':>5} {'dev':>4} {'batching':>11} {'eng':>3} {'batch':>5} {'frag':>4} {'descs':>5} {'READs/step':>10} "
              f"{'worker ms/req':>13} {'nixl':>6} {'copy':>6} {'python':>6} {'start_reads ms/req':>18} {'polls':>5}")
        for r in rows:
            print(f"{r['case']:>5} {r['device']:>4} {r['batching']:>11} {r['engines']:>3} {r['batch']:>5} "
                  f"{r['fragmentation']:>4.1f} {r['descriptors']:>5.1f} {r['reads_per_step']:>10.0f} {r['worker_ms']:>13.3f} "
                  f"{r['nixl_ms']:>6.3f} {r['copy_ms']:>6.3f} {r['python_ms']:>6.3f} {r['start_ms']:>18.3f} {r['polls']:>5.0f}")
        print(f"bytes verified: every step of every row (medians of --reps {args.reps} steps after one warm-up)")
        return
    rows = [r for case in (CASES if args.case == "all" else [args.case]) for r in run(case, args.reps, args.device, args.profile)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':>5} {'dev':>4} {'frag':>4} {'descs':>5} {'start ms':>8} {'nixl':>6} {'plan':>6} {'post':>6} {'checks':>6} {'done poll':>9} "
          f"{'nixl':>6} {'polls':>5} {'python ms':>9} {'max':>6}")
    for r in rows:
        print(f"{r['case']:>5} {r['device']:>4} {r['fragmentation']:>4.1f} {r['descriptors']:>5} {r['start_ms']:>8.3f} "
              f"{r['start_nixl_ms']:>6.3f} {r['plan_ms']:>6.3f} {r['post_ms']:>6.3f} {r['checks_ms']:>6.3f} {r['done_poll_ms']:>9.3f} "
              f"{r['done_poll_nixl_ms']:>6.3f} {r['polls']:>5.0f} {r['python_ms']:>9.3f} {r['python_ms_max']:>6.3f}")


if __name__ == "__main__":
    main()
