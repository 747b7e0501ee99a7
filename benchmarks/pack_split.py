"""Where pack mode's time goes for one fragmented request: the producer's gather, the READ, the scatter.

qwen3.5-397b-a17b (default), 8192 tokens, fragmented block ids on both sides, one process per rank
(P producer ranks, D decode ranks; cuda: every rank on GPU 0). Each decode process hosts two
consumers over one cache: one in pack mode, one in coalesced mode (direct reads, the comparison).
Each run holds the request afresh (so the producers gather it again, at hold time), waits for
that gather to finish (``--gather-on-path``: does not, so a consumer that asks at once waits for
it inside its read), reads it on every decode rank, and waits until every producer rank freed it.
Per run the slowest decode rank counts (the request is ready when all are); printed are medians:

  gather   the producer ranks' gather at hold() (ReadResult.gather_s: off the critical path)
  query    from the post to the producer's Staged notification, 0 when it came first (ReadResult.query_s)
  read     from the post until the READ is DONE (any wait for the notification included)
  scatter  the scatter into the local blocks
  total    post until the scatter finished (what the consumer reports), and direct mode's total
  alone    each decode rank in turn, the others idle: its last request's scatter again (same staging
           slice, same destinations, the index maps cached as in the engine), --alone-reps times, timed
           by the copier's CUDA events; medians and the GB/s of the median, three ways:
             device    the copier's stream first sleeps ~2 ms, so every launch is queued before the
                       start event: the device's own time (upload, index kernels, copy), its index part
             launched  as the engine runs it: host launch gaps between the kernels included
             queued    --alone-reps scatters queued back to back, first start -> last end, per scatter
           with the row width (bytes) and rows the scatter's index moves
  pipeline --pipeline N requests held, then read at once on every decode rank (several in flight on one
           consumer: request i+1's READ runs while request i scatters): wall time from the first post to
           the last DONE (slowest rank), beside N x (read + scatter) of the single-request runs

Run: python benchmarks/pack_split.py --device cuda            (P2 -> D8, UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y set here)
     python benchmarks/pack_split.py --device cuda --pipeline 8 --runs 7
     python benchmarks/pack_split.py --device cpu --prefill-tp 1 --decode-tp 1 --no-verify
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
import uuid

POLL_S = 0.0002
GATE_CYCLES = 4_000_000  # ~2 ms of GPU clock: longer than the host's launches of one rank's scatters


def _geometry(preset: str, tp_size: int, tp_rank: int):
    from hybrid_transfer.layout import RankGeometry, load_preset

    return RankGeometry(load_preset(preset), tp_size, tp_rank)


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _rank_main(conn, args, is_producer: bool, tp_size: int, rank: int, layouts, engine_id: str, incarnation: int):
    """One rank's process: builds its engine(s), then serves commands while polling them.

    ``layouts``: the request's blocks (a decode rank: one disjoint set per request of 'pipeline').
    """
    import logging

    import torch

    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine import Consumer, EngineConfig, Producer, decode_ticket, encode_ticket
    from hybrid_transfer.plan.stage_layout import stage_layout
    from hybrid_transfer.plan.types import PlanMode
    from hybrid_transfer.verify import check_destination_many, fill_source, poison

    layout = layouts[0]
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s {'p' if is_producer else 'd'}{rank} %(message)s")
    torch.set_num_threads(1)
    geometry = _geometry(args.preset, tp_size, rank)
    cache = HybridCache.allocate(geometry, args.num_blocks_p if is_producer else args.num_blocks_d, args.device)
    engines: dict[str, object] = {}
    if is_producer:
        staged = stage_layout(geometry, [r.addr for r in cache.regions], layout.block_ids, args.tokens).total_bytes
        config = EngineConfig(mode=PlanMode.PACK, staging_bytes=(max(2, args.pipeline) + 1) * staged + (1 << 20))
        if args.verify:
            fill_source(cache, layout, seed=1)
        else:
            for t in cache.tensors:
                t.random_(0, 256)
        _sync(args.device)
        engines["p"] = Producer(cache, config, engine_id=engine_id, incarnation=incarnation)
        conn.send(engines["p"].address)
    else:
        poison(cache)
        _sync(args.device)
        read_bytes = geometry.state_bytes_per_request + args.tokens * geometry.kv_bytes_per_token * len(
            geometry.model.attention_layers)
        engines["pack"] = Consumer(cache, EngineConfig(mode=PlanMode.PACK,
                                                       staging_bytes=max(1, args.pipeline) * read_bytes + (8 << 20)),
                                   engine_id=engine_id)
        engines["direct"] = Consumer(cache, EngineConfig(mode=PlanMode.COALESCED), engine_id=engine_id)
        copier = engines["pack"]._pack._copier
        scatter = copier.scatter

        def recording_scatter(staging, dst, length):  # the last single request's scatters, for "alone"
            if not recording[0]:
                return scatter(staging, dst, length)
            if len(last_scatters) >= 1 and last_scatters[-1][3] != runs_seen[0]:
                last_scatters.clear()
            last_scatters.append((staging, dst, length, runs_seen[0]))
            return scatter(staging, dst, length)

        copier.scatter = recording_scatter
        conn.send(None)
    last_scatters: list = []
    recording = [False]  # in a single request's read (not the pipeline's)
    runs_seen = [0]
    results: dict[str, object] = {}
    freed: set[str] = set()

    def poll() -> None:
        for name, engine in engines.items():
            if name == "p":
                freed.update(engine.poll())
            else:
                for r in engine.poll():
                    results[r.request_id] = r

    while True:
        if not conn.poll(0.001):
            poll()
            continue
        op, payload = conn.recv()
        if op == "stop":
            break
        if op == "addresses":
            engines["p"].set_engine_addresses(payload)
            conn.send(None)
        elif op == "hold":
            request_id, nonce = payload
            ticket = engines["p"].hold(request_id, layout.block_ids, args.tokens, nonce=nonce)
            conn.send(encode_ticket(ticket))
        elif op == "wait_staged":
            engines["p"].stager.wait_staged(payload)
            conn.send(None)
        elif op == "wait_freed":
            while payload not in freed:
                poll()
                time.sleep(POLL_S)
            conn.send(None)
        elif op == "alone":
            cuda = args.device == "cuda"

            def once(gated: bool) -> tuple[float, float]:
                if gated:  # every launch queued behind the sleep: the events see the device's own time
                    with torch.cuda.stream(copier._stream):
                        torch.cuda._sleep(GATE_CYCLES)
                tickets = [scatter(staging, dst, length) for staging, dst, length, _ in last_scatters]
                for t in tickets:
                    t.wait()
                return sum(t.elapsed_s for t in tickets), sum(t.index_s for t in tickets)

            launched = [once(False) for _ in range(payload)]
            device = [once(True) for _ in range(payload)] if cuda else launched
            nbytes = sum(int(length.sum()) for _, _, length, _ in last_scatters)
            rows = copier.last_rows
            # Queued back to back (as requests in flight are): first start -> last end, per scatter.
            tickets = [scatter(staging, dst, length) for _ in range(payload)
                       for staging, dst, length, _ in last_scatters]
            for t in tickets:
                t.wait()
            queued_s = tickets[0]._start.elapsed_time(tickets[-1]._end) / 1e3 / payload if cuda \
                else sum(t.elapsed_s for t in tickets) / payload
            conn.send({"bytes": nbytes, "ms": 1e3 * statistics.median(t for t, _ in launched),
                       "min_ms": 1e3 * min(t for t, _ in launched),
                       "device_ms": 1e3 * statistics.median(t for t, _ in device),
                       "device_index_ms": 1e3 * statistics.median(i for _, i in device),
                       "queued_ms": 1e3 * queued_s, "row_bytes": rows[0], "rows": rows[1],
                       "element_bytes": copier.row_width(rows[0]) if rows[0] else 0,
                       "index_cache": [copier.index_cache.hits, copier.index_cache.misses]
                       if copier.index_cache is not None else None})
        elif op == "read_many":
            runs_seen[0] += 1
            tickets = [decode_ticket(b) for b in payload]
            for ticket, lay in zip(tickets, layouts, strict=True):  # blocks of requests in flight never overlap
                engines["pack"].start_read(ticket, lay.block_ids)
            ids = [t.request_id for t in tickets]
            while not all(r in results for r in ids):
                poll()
                time.sleep(POLL_S)
            done = [results.pop(r) for r in ids]
            bad = [f"{type(r.error).__name__}: {r.error}" for r in done if not r.ok]
            conn.send({"error": bad[0]} if bad else
                      {"wall_s": max(r.finished_at for r in done) - min(r.posted_at for r in done),
                       "scatter_s": sum(r.scatter_s for r in done), "fallbacks": sum(r.num_fallback_sources
                                                                                     for r in done)})
        elif op == "read":
            runs_seen[0] += 1
            mode, ticket_bytes = payload
            ticket = decode_ticket(ticket_bytes)
            recording[0] = True
            engines[mode].start_read(ticket, layout.block_ids)
            while ticket.request_id not in results:
                poll()
                time.sleep(POLL_S)
            recording[0] = False
            r = results.pop(ticket.request_id)
            if not r.ok:
                conn.send({"error": f"{type(r.error).__name__}: {r.error}"})
                continue
            conn.send({"gather_s": r.gather_s, "query_s": r.query_s, "read_s": r.read_s, "scatter_s": r.scatter_s,
                       "total_s": r.finished_at - r.posted_at, "descriptors": r.num_descriptors,
                       "bytes": r.num_bytes, "packed": r.num_packed_sources, "fallbacks": r.num_fallback_sources})
        elif op == "check":
            check_destination_many(cache, [(lay, 1) for lay in layouts[: payload or 1]])
            conn.send(True)
    for engine in engines.values():
        engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--preset", default="qwen3.5-397b-a17b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--prefill-tp", type=int, default=2)
    parser.add_argument("--decode-tp", type=int, default=8)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=True,
                        help="fill with the oracle pattern and check the first pack read bitwise")
    parser.add_argument("--gather-on-path", action="store_true",
                        help="start the reads right after hold(), without waiting for the producers' gather")
    parser.add_argument("--log-level", default="WARNING", help="of the rank processes (DEBUG: pack read steps)")
    parser.add_argument("--alone-reps", type=int, default=20, help="scatters per decode rank for 'alone'")
    parser.add_argument("--pipeline", type=int, default=4,
                        help="requests read at once on every decode rank for 'pipeline' (0: skip)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.device == "cuda":
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    from hybrid_transfer.verify import make_request, make_requests

    p_geo, d_geo = _geometry(args.preset, args.prefill_tp, 0), _geometry(args.preset, args.decode_tp, 0)

    def needed(g) -> int:
        return sum(g.num_blocks_for_tokens(args.tokens) if k.kind.name == "ATTENTION" else 1
                   for k in g.tensor_map.groups)

    slots = max(1, args.pipeline)
    args.num_blocks_p, args.num_blocks_d = 2 * needed(p_geo) + 2, (slots + 1) * needed(d_geo) + 2
    p_layout = [make_request(p_geo, args.tokens, args.num_blocks_p, rng=1, fragmentation=1.0)]
    d_layout = make_requests(d_geo, [args.tokens] * slots, args.num_blocks_d, rng=2, fragmentation=1.0)
    ctx = mp.get_context("spawn")
    engine_p, engine_d = f"prefill-{uuid.uuid4().hex[:6]}", f"decode-{uuid.uuid4().hex[:6]}"
    incarnation = int.from_bytes(os.urandom(6), "little")
    procs, p_conns, d_conns = [], [], []
    for is_producer, tp, conns, layout, eid in ((True, args.prefill_tp, p_conns, p_layout, engine_p),
                                                (False, args.decode_tp, d_conns, d_layout, engine_d)):
        for rank in range(tp):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, args=(child, args, is_producer, tp, rank, layout, eid, incarnation),
                               daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
    try:
        addresses = [c.recv() for c in p_conns]
        for c in d_conns:
            c.recv()
        if args.prefill_tp > 1:
            for c in p_conns:
                c.send(("addresses", addresses))
                c.recv()
        runs: dict[str, list[dict]] = {"pack": [], "direct": []}
        for i in range(args.runs + 1):  # run 0 warms up handshakes, UCX wire-up and caches
            for mode in ("pack", "direct"):
                rid = f"{mode}-{i}"
                ticket = _hold_everywhere(p_conns, rid, args.gather_on_path)
                for c in d_conns:
                    c.send(("read", (mode, ticket)))
                per_rank = [c.recv() for c in d_conns]
                errors = [r["error"] for r in per_rank if "error" in r]
                if errors:
                    raise SystemExit(f"{mode} read failed: {errors[0]}")
                for c in p_conns:
                    c.send(("wait_freed", rid))
                    c.recv()
                if i == 0 and mode == "pack" and args.verify:
                    for c in d_conns:
                        c.send(("check", None))
                        c.recv()
                if i > 0:
                    runs[mode].append({k: max(r[k] for r in per_rank) for k in per_rank[0]})
        pipeline = []
        for rep in range(2 if args.pipeline else 0):  # the first warms the pool's larger slices
            rids = [f"pipe-{rep}-{k}" for k in range(args.pipeline)]
            tickets = [_hold_everywhere(p_conns, rid, args.gather_on_path) for rid in rids]
            for c in d_conns:
                c.send(("read_many", tickets))
            per_rank = [c.recv() for c in d_conns]
            errors = [r["error"] for r in per_rank if "error" in r]
            if errors:
                raise SystemExit(f"pipelined pack reads failed: {errors[0]}")
            for rid in rids:
                for c in p_conns:
                    c.send(("wait_freed", rid))
                    c.recv()
            if rep == 0 and args.verify:
                for c in d_conns:
                    c.send(("check", args.pipeline))
                    c.recv()
            if rep:
                pipeline.append(max(per_rank, key=lambda r: r["wall_s"]))
        alone = []
        for c in d_conns:  # one decode rank at a time: the others wait for their next command
            c.send(("alone", args.alone_reps))
            alone.append(c.recv())
        report = _report(args, runs)
        if pipeline:
            p = report["pack"]
            report["pipeline"] = {"requests": args.pipeline, "wall_ms": 1e3 * pipeline[0]["wall_s"],
                                  "scatter_ms_sum": 1e3 * pipeline[0]["scatter_s"],
                                  "fallbacks": pipeline[0]["fallbacks"],
                                  "serial_ms": args.pipeline * (p["read_ms"] + p["scatter_ms"])}
        report["alone"] = {"bytes_per_rank": [a["bytes"] for a in alone], "ms": [a["ms"] for a in alone],
                           "gbps": [a["bytes"] / a["ms"] / 1e6 for a in alone],
                           "device_ms": [a["device_ms"] for a in alone],
                           "device_index_ms": [a["device_index_ms"] for a in alone],
                           "device_gbps": [a["bytes"] / a["device_ms"] / 1e6 for a in alone],
                           "row_bytes": [a["row_bytes"] for a in alone], "rows": [a["rows"] for a in alone],
                           "element_bytes": [a["element_bytes"] for a in alone],
                           "queued_ms": [a["queued_ms"] for a in alone],
                           "queued_gbps": [a["bytes"] / a["queued_ms"] / 1e6 for a in alone],
                           "index_cache_hits_misses": [a["index_cache"] for a in alone]}
    finally:
        for c in p_conns + d_conns:
            try:
                c.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(report)
    return 0


def _hold_everywhere(p_conns, rid: str, gather_on_path: bool) -> bytes:
    """Hold ``rid`` on every producer rank (rank 0 draws the nonce), wait for the gathers unless told not to."""
    p_conns[0].send(("hold", (rid, None)))
    ticket = p_conns[0].recv()
    nonce = _nonce(ticket)
    for c in p_conns[1:]:
        c.send(("hold", (rid, nonce)))
        c.recv()
    if not gather_on_path:
        for c in p_conns:
            c.send(("wait_staged", rid))
            c.recv()
    return ticket


def _nonce(ticket_bytes: bytes) -> int:
    from hybrid_transfer.engine import decode_ticket

    return decode_ticket(ticket_bytes).nonce


def _report(args, runs: dict[str, list[dict]]) -> dict:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    pack, direct = runs["pack"], runs["direct"]
    return {
        "preset": args.preset, "tokens": args.tokens, "prefill_tp": args.prefill_tp, "decode_tp": args.decode_tp,
        "device": args.device, "runs": args.runs, "verified": args.verify, "gather_on_path": args.gather_on_path,
        "bytes_per_decode_rank": pack[0]["bytes"],
        "pack": {"descriptors": pack[0]["descriptors"], "fallbacks": max(r["fallbacks"] for r in pack),
                 "gather_ms": 1e3 * med("pack", "gather_s"), "query_ms": 1e3 * med("pack", "query_s"),
                 "read_ms": 1e3 * med("pack", "read_s"),
                 "scatter_ms": 1e3 * med("pack", "scatter_s"), "total_ms": 1e3 * med("pack", "total_s")},
        "direct": {"descriptors": direct[0]["descriptors"], "read_ms": 1e3 * med("direct", "read_s"),
                   "total_ms": 1e3 * med("direct", "total_s")},
    }


def _print(r: dict) -> None:
    p, d = r["pack"], r["direct"]
    print(f"{r['preset']}, {r['tokens']} tokens, P{r['prefill_tp']} -> D{r['decode_tp']}, fragmented, "
          f"{r['device']}, {r['runs']} runs (median over runs of the slowest decode rank)"
          f"{', verified bitwise' if r['verified'] else ''}"
          f"{', reads start before the gather ends' if r['gather_on_path'] else ''}")
    print(f"  bytes per decode rank  {r['bytes_per_decode_rank']:,}")
    print(f"  pack    {p['descriptors']:>4} descriptors  gather {p['gather_ms']:8.3f} ms (producer, at hold)"
          f"  read {p['read_ms']:8.3f} ms (query {p['query_ms']:.3f})  scatter {p['scatter_ms']:8.3f} ms"
          f"  post->done {p['total_ms']:8.3f} ms  fallbacks {p['fallbacks']}")
    print(f"  direct  {d['descriptors']:>4} descriptors  read {d['read_ms']:8.3f} ms  post->done {d['total_ms']:8.3f} ms")
    pl = r.get("pipeline")
    if pl:
        print(f"  pipeline  {pl['requests']} requests at once per decode rank: {pl['wall_ms']:8.3f} ms first post -> "
              f"last done (slowest rank), vs {pl['serial_ms']:8.3f} ms = {pl['requests']} x (read + scatter) of "
              f"one request; scatters {pl['scatter_ms_sum']:.3f} ms in all; fallbacks {pl['fallbacks']}")
    a = r.get("alone")
    if a:
        gb = a["gbps"]
        print(f"  scatter alone, as launched (each decode rank by itself, median of --alone-reps): {min(gb):,.0f}-{max(gb):,.0f} GB/s "
              f"({min(a['ms']):.3f}-{max(a['ms']):.3f} ms for {max(a['bytes_per_rank']):,} B); "
              f"index cache hits/misses {a['index_cache_hits_misses'][0]}")
        dv = a["device_gbps"]
        how = "launches queued first" if r["device"] == "cuda" else "cpu: as launched"
        print(f"  scatter alone, device time ({how}): {min(dv):,.0f}-{max(dv):,.0f} GB/s "
              f"({min(a['device_ms']):.3f}-{max(a['device_ms']):.3f} ms, of it index "
              f"{min(a['device_index_ms']):.3f}-{max(a['device_index_ms']):.3f} ms); rows of "
              f"{sorted(set(a['row_bytes']))} B in {sorted(set(a['element_bytes']))}-byte elements, "
              f"{min(a['rows']):,}-{max(a['rows']):,} rows")
        q = a["queued_gbps"]
        print(f"  scatter alone, --alone-reps queued back to back (first start -> last end): {min(q):,.0f}-{max(q):,.0f} "
              f"GB/s ({min(a['queued_ms']):.3f}-{max(a['queued_ms']):.3f} ms per scatter)")


if __name__ == "__main__":
    raise SystemExit(main())
