"""How should a plan's descriptors reach NIXL? Per-request cost of three ways to build a READ.

  direct     initialize_xfer on the coalesced plan's Nx3 arrays (engine PrepStrategy.DIRECT)
  prepped    prep_xfer_dlist on both arrays per request, then make_prepped_xfer (PrepStrategy.PREPPED)
  per-peer   lists prepared once per peer at naive granularity (vLLM's way), then make_prepped_xfer
             with index arrays of the naive plan's rows (NIXL merges consecutive ones); the index
             lookup is timed apart, since an engine could derive indices arithmetically

Two spawned processes with real caches of a preset (default qwen3.5-0.8b, TP1 -> TP1), contiguous
and fragmented requests. Reported per strategy: descriptors handed to NIXL, the time to build the
handle (median), and post-to-DONE of the READ (median).

Run: python benchmarks/prep_strategy.py [--preset qwen3.5-0.8b] [--tokens 8192] [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np


def _geometry(preset: str):
    from hybrid_transfer.layout import RankGeometry, load_preset

    return RankGeometry(load_preset(preset), 1, 0)


def _producer(conn, preset: str, num_blocks: int) -> None:
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine.agent import NixlAgent
    from hybrid_transfer.engine.config import EngineConfig, ProgressPolicy
    from hybrid_transfer.planner_input import describe_cache

    cache = HybridCache.allocate(_geometry(preset), num_blocks)
    agent = NixlAgent(f"prep-producer-{os.getpid()}", EngineConfig(progress=ProgressPolicy.OFF))
    agent.register(cache.regions)
    conn.send((agent.metadata, describe_cache(cache)))
    while not any(b"stop" in m for m in agent.get_notifs().values()):
        time.sleep(0.005)
    agent.close()


def _timed_read(agent, peer, make) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    handle, n = make()
    t1 = time.perf_counter()
    state = agent._agent.transfer(handle)
    while state == "PROC":
        state = agent._agent.check_xfer_state(handle)
    t2 = time.perf_counter()
    if state != "DONE":
        raise RuntimeError(f"READ ended in {state}")
    agent._agent.release_xfer_handle(handle)
    return t1 - t0, t2 - t0, n


def _consumer(conn, preset: str, num_blocks: int, num_tokens: int, reps: int) -> None:
    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.engine.agent import NixlAgent
    from hybrid_transfer.engine.config import EngineConfig, ProgressPolicy
    from hybrid_transfer.plan.planner import Planner
    from hybrid_transfer.plan.types import PlanMode
    from hybrid_transfer.planner_input import describe_cache
    from hybrid_transfer.verify import make_request

    geometry = _geometry(preset)
    cache = HybridCache.allocate(geometry, num_blocks)
    agent = NixlAgent(f"prep-consumer-{os.getpid()}", EngineConfig(progress=ProgressPolicy.OFF))
    agent.register(cache.regions)
    metadata, remote_desc = conn.recv()
    peer = agent.add_remote(metadata)
    local_desc = describe_cache(cache)
    planner = Planner(geometry.model, local_desc, [remote_desc])
    nixl = agent._agent
    rows = []
    for frag in (0.0, 1.0):
        remote_req = make_request(geometry, num_tokens, num_blocks, rng=1, fragmentation=frag)
        local_req = make_request(geometry, num_tokens, num_blocks, rng=2, fragmentation=frag)
        coalesced = planner.plan(local_req.block_ids, remote_req.block_ids, num_tokens, PlanMode.COALESCED)
        naive = planner.plan(local_req.block_ids, remote_req.block_ids, num_tokens, PlanMode.NAIVE)
        c_src, n_src = coalesced.sources[0], naive.sources[0]
        # Per-peer lists: every naive piece of this request, sorted by address.
        local_all = np.ascontiguousarray(n_src.local_descs()[np.argsort(n_src.local_addr)])
        remote_all = np.ascontiguousarray(n_src.remote_descs()[np.argsort(n_src.remote_addr)])
        local_h = nixl.prep_xfer_dlist("", local_all, "DRAM")
        remote_h = nixl.prep_xfer_dlist(peer, remote_all, "DRAM")
        t0 = time.perf_counter()
        li = np.searchsorted(local_all[:, 0], n_src.local_addr).astype(np.int32)
        ri = np.searchsorted(remote_all[:, 0], n_src.remote_addr).astype(np.int32)
        lookup_s = time.perf_counter() - t0

        def direct(src=c_src):
            return nixl.initialize_xfer("READ", nixl.get_xfer_descs(src.local_descs(), "DRAM"),
                                        nixl.get_xfer_descs(src.remote_descs(), "DRAM"), peer), src.num_descriptors

        def prepped(src=c_src):
            lh = nixl.prep_xfer_dlist("", src.local_descs(), "DRAM")
            rh = nixl.prep_xfer_dlist(peer, src.remote_descs(), "DRAM")
            idx = np.arange(src.num_descriptors, dtype=np.int32)
            return nixl.make_prepped_xfer("READ", lh, idx, rh, idx), src.num_descriptors

        def per_peer(li=li, ri=ri, local_h=local_h, remote_h=remote_h):
            return nixl.make_prepped_xfer("READ", local_h, li, remote_h, ri), int(li.shape[0])

        for name, make in (("direct", direct), ("prepped", prepped), ("per-peer", per_peer)):
            _timed_read(agent, peer, make)  # warm-up
            samples = [_timed_read(agent, peer, make) for _ in range(reps)]
            rows.append({
                "fragmentation": frag, "strategy": name, "descriptors": samples[0][2],
                "bytes": c_src.total_bytes,
                "build_ms": statistics.median(s[0] for s in samples) * 1e3,
                "post_to_done_ms": statistics.median(s[1] for s in samples) * 1e3,
                "index_lookup_ms": lookup_s * 1e3 if name == "per-peer" else 0.0,
            })
    agent.send_notif(peer, b"stop")
    conn.send(rows)
    agent.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen3.5-0.8b")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    geometry = _geometry(args.preset)
    per_request = sum(geometry.num_blocks_for_tokens(args.tokens) if g.kind.name == "ATTENTION" else 1
                      for g in geometry.tensor_map.groups)
    num_blocks = 3 * per_request
    ctx = mp.get_context("spawn")
    p_conn, p_child = ctx.Pipe()
    c_conn, c_child = ctx.Pipe()
    producer = ctx.Process(target=_producer, args=(p_child, args.preset, num_blocks))
    consumer = ctx.Process(target=_consumer, args=(c_child, args.preset, num_blocks, args.tokens, args.reps))
    producer.start()
    consumer.start()
    c_conn.send(p_conn.recv())
    rows = c_conn.recv()
    producer.join()
    consumer.join()
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{args.preset} TP1 -> TP1, {args.tokens} tokens, {rows[0]['bytes'] / 2**20:.1f} MiB per request")
    print(f"{'frag':>5} {'strategy':>9} {'descs':>7} {'build ms':>9} {'post->DONE ms':>14} {'lookup ms':>10}")
    for r in rows:
        print(f"{r['fragmentation']:>5.1f} {r['strategy']:>9} {r['descriptors']:>7} {r['build_ms']:>9.3f} "
              f"{r['post_to_done_ms']:>14.2f} {r['index_lookup_ms']:>10.3f}")


if __name__ == "__main__":
    main()
