"""Head-of-line cost of reads batched per step: a small request that shares its step's READ with a long one.

With ``read_batching="per_step"`` every direct source of a step's requests on one producer agent goes out
as one READ (docs/lifecycle.md#batched-reads), so the requests of a handle finish together: a small
request batched with a 131,072-token one is DONE only when the long one is. This measures it, P1 -> D1,
real NIXL (UCX, loopback), one process per rank. Each repetition is one step: ``start_reads([small,
long])`` under each setting, then polls until both are DONE; it reports the median time from the
call to each request's DONE (ReadResult.finished_at - started_at), and the small request read alone
in a step of its own as the baseline. Nothing is asserted: it states the cost.

On a CPU host UCX copies the bytes inside the post on the calling thread (engine/agent.py), so without
``--post-thread`` the long request's copy holds the worker thread whatever the setting; with it
(EngineConfig.post_thread) posts run on a second thread and per_request's small READ completes alone.

Run: python benchmarks/read_batch_hol.py [--preset qwen3.5-0.8b] [--long 131072] [--small 2048] [--reps 5]
     [--post-thread]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

from request_overhead import _blocks_for, _geometry, _producer


def _consumer(conn, preset, num_blocks, tokens, reps, post_thread) -> None:
    from hybrid_transfer import Consumer, EngineConfig, HybridCache
    from hybrid_transfer.engine.read_batch import Read
    from hybrid_transfer.verify import make_requests

    geometry = _geometry(preset, 1, 0)
    address = conn.recv()
    out = {}
    for batching in ("per_step", "per_request"):
        consumer = Consumer(HybridCache.allocate(geometry, num_blocks), EngineConfig(read_batching=batching,
                                                                                         post_thread=post_thread))
        consumer.connect(address)
        local = make_requests(geometry, tokens, num_blocks, rng=5)
        for step in ("pair", "alone"):
            times: dict[str, list[float]] = {}
            for i in range(reps + 1):
                tickets = conn.recv()
                reads = [Read(t, lay.block_ids, t.num_tokens) for t, lay in zip(tickets, local, strict=False)]
                errors = consumer.start_reads(reads)
                if any(errors):
                    raise RuntimeError(f"refused: {errors}")
                done = []
                while len(done) < len(reads):
                    done += consumer.poll()
                    time.sleep(0)
                for r in done:
                    if not r.ok:
                        raise RuntimeError(f"read failed: {r.error}")
                    if i:  # the first step warms up
                        kind = "long" if r.num_bytes == max(x.num_bytes for x in done) and len(done) > 1 else "small"
                        times.setdefault(kind, []).append(r.finished_at - r.started_at)
                conn.send("next")
            out[f"{batching}/{step}"] = {k: 1e3 * statistics.median(v) for k, v in times.items()}
        consumer.close()
    conn.send(out)


def run(preset: str, long_tokens: int, small_tokens: int, reps: int, post_thread: bool = False) -> dict:
    from hybrid_transfer.verify import make_requests

    geo = _geometry(preset, 1, 0)
    tokens = [small_tokens, long_tokens]
    num_blocks = 2 * sum(_blocks_for(geo, n) for n in tokens) + 2
    ctx = mp.get_context("spawn")
    p_parent, p_child = ctx.Pipe()
    producer = ctx.Process(target=_producer, args=(p_child, preset, 1, 0, num_blocks, "cpu"), daemon=True)
    producer.start()
    c_parent, c_child = ctx.Pipe()
    consumer = ctx.Process(target=_consumer, args=(c_child, preset, num_blocks, tokens, reps, post_thread), daemon=True)
    consumer.start()
    c_parent.send(p_parent.recv())
    remote = make_requests(geo, tokens, num_blocks, rng=3)
    n = 0
    for _batching in ("per_step", "per_request"):
        for step in ("pair", "alone"):
            layouts = list(zip(tokens, remote, strict=True)) if step == "pair" else [(small_tokens, remote[0])]
            for _ in range(reps + 1):
                tickets = []
                for count, lay in layouts:
                    n += 1
                    p_parent.send((f"req-{n}", lay.block_ids, count, None))
                    tickets.append(p_parent.recv())
                c_parent.send(tickets)
                if not c_parent.poll(600):
                    raise RuntimeError("the consumer did not answer")
                c_parent.recv()
    out = c_parent.recv()
    consumer.join()
    p_parent.send(None)
    producer.join()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--long", type=int, default=131072)
    parser.add_argument("--small", type=int, default=2048)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--post-thread", action="store_true", help="EngineConfig.post_thread: post off the worker thread")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = run(args.preset, args.long, args.small, args.reps, args.post_thread)
    if args.json:
        print(json.dumps(out, indent=1))
        return
    print(f"P1->D1 {args.preset} on CPU, {args.small} + {args.long} tokens, post thread "
          f"{'on' if args.post_thread else 'off'}, medians of {args.reps} steps: ms from start_reads to DONE")
    print(f"{'batching':>11} {'small alone':>11} {'small, paired':>13} {'long, paired':>12} {'small paired / alone':>20}")
    for batching in ("per_step", "per_request"):
        alone, pair = out[f"{batching}/alone"]["small"], out[f"{batching}/pair"]
        print(f"{batching:>11} {alone:>11.2f} {pair['small']:>13.2f} {pair['long']:>12.2f} "
              f"{pair['small'] / alone:>20.1f}")


if __name__ == "__main__":
    main()
