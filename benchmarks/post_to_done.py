"""Post-to-DONE time of one request through the engine: start_read until poll() reports it DONE.

One spawned process per producer rank and one for the measured consumer rank, CPU DRAM, loopback,
default EngineConfig (progress OFF, DIRECT descriptors, coalesced plans). The consumer connects
first (eager handshake) and reads once to warm up; then each repetition holds the same blocks
under a new request id and reads them again. Reported: descriptors, bytes, the time inside
start_read (plan, validation, post; on CPU the copy itself may run inside the post) and
post-to-DONE (median, min, max).

Cases:
  small  qwen3.5-0.8b, TP1 -> TP1, 128 tokens
  large  qwen3.5-397b-a17b, TP2 -> TP8 (decode rank 0 of 8), 8192 tokens: docs/planner.md#worked-example,
         149,836,800 bytes into the rank; contiguous and fragmented block ids

Run: python benchmarks/post_to_done.py [--case small|large|all] [--reps 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _ranks import answer, hold_everywhere, serve_holds, spawn, start_producers, stop_producers
from _ranks import blocks_for as _blocks_for
from _ranks import geometry as _geometry

CASES = {
    "small": {"preset": "qwen3.5-0.8b", "prefill_tp": 1, "decode_tp": 1, "tokens": 128},
    "large": {"preset": "qwen3.5-397b-a17b", "prefill_tp": 2, "decode_tp": 8, "tokens": 8192},
}


def _layout(geometry, tokens: int, num_blocks: int, fragmentation: float, seed: int):
    from hybrid_transfer.verify import make_request

    return make_request(geometry, tokens, num_blocks, rng=seed, fragmentation=fragmentation)


def _producer(conn, preset, tp_size, rank, num_blocks, engine_id, incarnation) -> None:
    from hybrid_transfer import HybridCache, Producer

    producer = Producer(HybridCache.allocate(_geometry(preset, tp_size, rank), num_blocks), engine_id=engine_id,
                        incarnation=incarnation)
    serve_holds(conn, producer, tp_size, wait_s=0.001, sleep_s=0.0)


def _consumer(conn, preset, decode_tp, num_blocks, tokens, reps) -> None:
    from hybrid_transfer import Consumer, HybridCache

    geometry = _geometry(preset, decode_tp, 0)
    consumer = Consumer(HybridCache.allocate(geometry, num_blocks))
    consumer.connect(conn.recv())
    rows = []
    for frag in (0.0, 1.0):
        local = _layout(geometry, tokens, num_blocks, frag, seed=7)
        starts, totals = [], []
        for i in range(reps + 1):
            ticket = conn.recv()
            t0 = time.perf_counter()
            consumer.start_read(ticket, local.block_ids, expected_state_position=tokens)
            t1 = time.perf_counter()
            results = []
            while not results:
                results = consumer.poll()
            t2 = time.perf_counter()
            if not results[0].ok:
                raise RuntimeError(f"read failed: {results[0].error}")
            if i:  # the first read of each layout warms up
                starts.append(t1 - t0)
                totals.append(t2 - t0)
            conn.send("next")
        rows.append({"fragmentation": frag, "descriptors": results[0].num_descriptors,
                     "bytes": results[0].num_bytes, "start_read_ms": statistics.median(starts) * 1e3,
                     "post_to_done_ms": statistics.median(totals) * 1e3,
                     "min_ms": min(totals) * 1e3, "max_ms": max(totals) * 1e3})
    conn.send(rows)
    consumer.close()


def run(case: str, reps: int) -> list[dict]:
    c = CASES[case]
    preset, p_tp, d_tp, tokens = c["preset"], c["prefill_tp"], c["decode_tp"], c["tokens"]
    p_geo, d_geo = _geometry(preset, p_tp, 0), _geometry(preset, d_tp, 0)
    p_blocks, d_blocks = 2 * _blocks_for(p_geo, tokens) + 2, 2 * _blocks_for(d_geo, tokens) + 2
    producers, addresses = start_producers(_producer, p_tp, lambda rank: (preset, p_tp, rank, p_blocks, "bench", 1),
                                           daemon=False)
    consumer, c_parent = spawn(_consumer, (preset, d_tp, d_blocks, tokens, reps), daemon=False)
    c_parent.send(addresses[0])
    n = 0
    for frag in (0.0, 1.0):
        remote = _layout(p_geo, tokens, p_blocks, frag, seed=3)
        for _ in range(reps + 1):
            n += 1
            c_parent.send(hold_everywhere(producers, f"req-{n}", remote.block_ids, tokens))
            answer(c_parent, consumer)
    rows = answer(c_parent, consumer)
    consumer.join()
    stop_producers(producers)
    return [{"case": case, "preset": preset, "prefill_tp": p_tp, "decode_tp": d_tp, "tokens": tokens, **r}
            for r in rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=[*CASES, "all"], default="all")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [r for case in (CASES if args.case == "all" else [args.case]) for r in run(case, args.reps)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'case':>6} {'frag':>5} {'descs':>6} {'MB':>8} {'start_read ms':>14} {'post->DONE ms':>14} "
          f"{'min':>7} {'max':>7} {'GB/s':>6}")
    for r in rows:
        print(f"{r['case']:>6} {r['fragmentation']:>5.1f} {r['descriptors']:>6} {r['bytes'] / 1e6:>8.2f} "
              f"{r['start_read_ms']:>14.2f} {r['post_to_done_ms']:>14.2f} {r['min_ms']:>7.2f} {r['max_ms']:>7.2f} "
              f"{r['bytes'] / r['post_to_done_ms'] / 1e6:>6.2f}")


if __name__ == "__main__":
    main()
