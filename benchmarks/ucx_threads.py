"""Choose the UCX thread-pool defaults: direct-path GB/s of one decode rank per (num_threads, split_batch_size).

One spawned process per producer rank (holding every request), the measured consumer (decode rank 0)
in this process; per setting a fresh Consumer with ``EngineConfig(num_backend_threads=T,
split_batch_size=S)`` is connected and reads ``--requests`` requests (distinct blocks on both
sides) keeping ``--concurrency`` in flight, ``--rounds`` times; printed are the median round's GB/s
(payload bytes / first post -> last DONE), post -> DONE p50, the consumer's ``start_read`` median
and the process CPU seconds of that round.

Run on the GPU host: python benchmarks/ucx_threads.py --device cuda [--case p1d1] [--frag 0,1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

from _ranks import blocks_for as _blocks_for
from _ranks import device as _device
from _ranks import geometry as _geometry
from _ranks import hold_everywhere, serve_holds, start_producers, stop_producers

CASES = {
    "small": {"preset": "qwen3.5-0.8b", "prefill_tp": 1, "decode_tp": 1, "tokens": 2048},
    "p1d1": {"preset": "qwen3.5-397b-a17b", "prefill_tp": 1, "decode_tp": 1, "tokens": 8192},
    "p2d8": {"preset": "qwen3.5-397b-a17b", "prefill_tp": 2, "decode_tp": 8, "tokens": 8192},
}
SETTINGS = ((0, None), (2, 16), (4, 8), (4, 16), (4, 32), (8, 16), (8, 32))


def _producer(conn, preset, tp_size, rank, num_blocks, device) -> None:
    from hybrid_transfer import HybridCache, Producer

    producer = Producer(HybridCache.allocate(_geometry(preset, tp_size, rank), num_blocks, _device(device)),
                        engine_id="ucx-threads", incarnation=2)
    serve_holds(conn, producer, tp_size)


def _window(consumer, tickets, local_ids, tokens, concurrency):
    """Read every ticket, ``concurrency`` in flight; (GB/s, p50 latency ms, start_read median ms, CPU s)."""
    queue = list(tickets)
    in_flight: dict[str, float] = {}
    free = list(range(concurrency))
    slot_of: dict[str, int] = {}
    lat, starts, nbytes = [], [], 0
    cpu0, t_first = time.process_time(), time.monotonic()
    i = 0
    while i < len(queue) or in_flight:
        if i < len(queue) and free:
            ticket = queue[i]
            slot = free.pop()
            t0 = time.monotonic()
            consumer.start_read(ticket, local_ids[slot], expected_state_position=tokens)
            starts.append(time.monotonic() - t0)
            in_flight[ticket.request_id], slot_of[ticket.request_id] = t0, slot
            i += 1
        for r in consumer.poll():
            if not r.ok:
                raise RuntimeError(f"read failed: {r.error}")
            lat.append(time.monotonic() - in_flight.pop(r.request_id))
            free.append(slot_of.pop(r.request_id))
            nbytes += r.num_bytes
    window = time.monotonic() - t_first
    return nbytes / window / 1e9, 1e3 * statistics.median(lat), 1e3 * statistics.median(starts), \
        time.process_time() - cpu0


def run(case: str, frag: float, device: str, requests: int, concurrency: int, rounds: int, settings) -> list[dict]:
    from hybrid_transfer import Consumer, EngineConfig, HybridCache

    c = CASES[case]
    preset, p_tp, d_tp, tokens = c["preset"], c["prefill_tp"], c["decode_tp"], c["tokens"]
    p_geo, d_geo = _geometry(preset, p_tp, 0), _geometry(preset, d_tp, 0)
    p_blocks = concurrency * _blocks_for(p_geo, tokens) + 2
    d_blocks = concurrency * _blocks_for(d_geo, tokens) + 2
    producers, addresses = start_producers(_producer, p_tp, lambda rank: (preset, p_tp, rank, p_blocks, device))
    cache = HybridCache.allocate(d_geo, d_blocks, _device(device))
    local_ids = _disjoint(d_geo, tokens, d_blocks, concurrency, frag, seed=7)
    remote_ids = _disjoint(p_geo, tokens, p_blocks, concurrency, frag, seed=3)
    rows, n = [], 0

    def hold_all(tag: str):
        nonlocal n
        tickets = []
        for k in range(requests):
            n += 1
            tickets.append(hold_everywhere(producers, f"{tag}-{n}", remote_ids[k % concurrency], tokens))
        return tickets

    try:
        for threads, split in settings:
            config = EngineConfig(num_backend_threads=threads, split_batch_size=split)
            with Consumer(cache, config) as consumer:
                consumer.connect(addresses[0])
                _window(consumer, hold_all("warm")[:concurrency], local_ids, tokens, concurrency)
                results = [_window(consumer, hold_all("timed"), local_ids, tokens, concurrency)
                           for _ in range(rounds)]
            gbps, p50, start, cpu = sorted(results)[len(results) // 2]
            rows.append({"case": case, "fragmentation": frag, "device": device, "num_threads": threads,
                         "split_batch_size": split, "gbps": gbps, "gbps_rounds": [r[0] for r in results],
                         "p50_ms": p50, "start_read_ms": start, "cpu_s": cpu})
            print(f"{case} frag {frag:.1f} threads {threads:>2} split {split!s:>4}: {gbps:8.1f} GB/s "
                  f"(rounds {', '.join(f'{r[0]:.1f}' for r in results)})  p50 {p50:7.3f} ms  "
                  f"start_read {start:6.3f} ms  CPU {cpu:5.2f} s", flush=True)
    finally:
        stop_producers(producers, timeout=30)
    return rows


def _disjoint(geometry, tokens: int, num_blocks: int, count: int, frag: float, seed: int):
    """``count`` requests' block ids, no block shared (the consumer refuses busy blocks)."""
    from hybrid_transfer.verify import make_requests

    return [r.block_ids for r in make_requests(geometry, [tokens] * count, num_blocks, rng=seed,
                                                fragmentation=frag)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=list(CASES), default="p1d1")
    parser.add_argument("--frag", default="0,1", help="comma-separated fragmentations")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default=None, help="T:S,T:S,... (S may be 'none'); default: a fixed sweep")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    if args.device == "cuda":
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    settings = SETTINGS
    if args.settings:
        settings = tuple((int(t), None if s == "none" else int(s))
                         for t, s in (x.split(":") for x in args.settings.split(",")))
    rows = [r for f in args.frag.split(",") for r in run(args.case, float(f), args.device, args.requests,
                                                          args.concurrency, args.rounds, settings)]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
