"""The mapped path's GPU copy alone (issue 28): one gather kernel per step over the planner's real ranges.

Not a test: run `python benchmarks/mapped_copy.py [--case p1d1|p2d8] [--frag 0,1] [--step 16] [--reps 10]` on a
GPU host. A producer rank's and a decode rank's caches of qwen3.5-397b-a17b (8,192 tokens per request) are
allocated on one GPU in this process; a step of ``--step`` requests is planned (coalesced, fragmented ids
as the bench draws them) and moved by ``RangeCopier.copy`` exactly as the mapped path posts it (the
mapping itself adds nothing to the copy: CUDA IPC gives the same device addresses). Prints, per step: the
ranges and bytes, the worker thread's time in the call split into the chunk table (numpy), the table's
upload and the kernel launch, the GPU time (events around the call), and a contiguous copy of the same
bytes (the ceiling); every range is then compared with its source. docs/benchmarks.md#issue-28.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.engine.mapped.cuda_ipc import RangeCopier
from hybrid_transfer.engine.pack.gather_scatter import alias_bytes
from hybrid_transfer.engine.read_batch import batch_plans
from hybrid_transfer.layout import RankGeometry, load_preset
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.scenario import blocks_needed, make_block_ids
from hybrid_transfer.plan.types import PlanMode
from hybrid_transfer.planner_input import describe_cache

CASES = {"p1d1": (1, 1), "p2d8": (2, 8)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", choices=list(CASES), default="p1d1")
    parser.add_argument("--frag", default="0,1")
    parser.add_argument("--step", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--chunk-kib", type=int, default=None,
                        help="bytes per kernel program in KiB (default: the engine's, cuda_ipc.CHUNK_BYTES)")
    args = parser.parse_args()
    model = load_preset("qwen3.5-397b-a17b")
    p_tp, d_tp = CASES[args.case]
    dev = torch.device("cuda", 0)
    p_geos = [RankGeometry(model, p_tp, r) for r in range(p_tp)]
    c_geo = RankGeometry(model, d_tp, 0)
    need_p = blocks_needed(model, p_geos[0].block_size, args.tokens)
    need_c = blocks_needed(model, c_geo.block_size, args.tokens)
    pool_p, pool_c = args.step * sum(need_p) + 8, args.step * sum(need_c) + 8
    producers = [HybridCache.allocate(g, pool_p, dev) for g in p_geos]
    for p in producers:
        for t in p.tensors:
            t.random_(0, 256)
    consumer = HybridCache.allocate(c_geo, pool_c, dev)
    planner = Planner(model, describe_cache(consumer), [describe_cache(p) for p in producers])
    copier = RangeCopier(dev) if args.chunk_kib is None else RangeCopier(dev, args.chunk_kib << 10)
    print(f"{args.case} {args.tokens} tokens, {args.step} requests per step, decode rank 0")
    print("frag  ranges  MB/step  table_us  upload_us  launch_us  cpu_us/req  gpu_ms   GB/s  contig_GB/s  /contig  bad")
    for frag in (float(f) for f in args.frag.split(",")):
        rng = np.random.default_rng(int(frag * 100))
        # One draw for the whole step, cut into requests: no two requests share a block on either side.
        local_all = make_block_ids([n * args.step for n in need_c], pool_c, frag, rng)
        remote_all = make_block_ids([n * args.step for n in need_p], pool_p, frag, rng)
        items = []
        for k in range(args.step):
            local = [np.asarray(g[k * n:(k + 1) * n], np.int64) for g, n in zip(local_all, need_c, strict=True)]
            remote = [list(g[k * n:(k + 1) * n]) for g, n in zip(remote_all, need_p, strict=True)]
            items.append((local, remote, args.tokens))
        batch = batch_plans(planner.plan_many(items, PlanMode.COALESCED))
        dst = np.concatenate([r.local[:, 0] for r in batch.reads])
        src = np.concatenate([r.remote[:, 0] for r in batch.reads])
        lengths = np.concatenate([r.local[:, 1] for r in batch.reads])
        total = int(lengths.sum())
        contig_dst = torch.empty(total, dtype=torch.uint8, device=dev)
        contig_src = alias_bytes(producers[0].regions[0].addr, min(total, producers[0].regions[0].length), dev)
        splits, cpu, gpu, contig = [], [], [], []
        for r in range(args.reps + 2):
            torch.cuda.synchronize()
            start = torch.cuda.Event(enable_timing=True)
            start.record(torch.cuda.current_stream())
            t0 = time.perf_counter()
            done = copier.copy(dst, src, lengths)
            cpu_s = time.perf_counter() - t0
            done.synchronize()
            end = torch.cuda.Event(enable_timing=True)
            end.record(copier._stream)
            end.synchronize()
            c0 = torch.cuda.Event(enable_timing=True)
            c1 = torch.cuda.Event(enable_timing=True)
            c0.record()
            contig_dst[:contig_src.numel()].copy_(contig_src)
            c1.record()
            c1.synchronize()
            if r >= 2:  # two warm-ups: Triton's compile, the pinned tables
                splits.append(copier.last_split)
                cpu.append(cpu_s)
                gpu.append(start.elapsed_time(end))
                contig.append(c0.elapsed_time(c1) * total / contig_src.numel())
        bad = 0
        for i in np.linspace(0, len(lengths) - 1, 24).astype(int):
            a = alias_bytes(int(src[i]), int(lengths[i]), dev)
            b = alias_bytes(int(dst[i]), int(lengths[i]), dev)
            bad += not torch.equal(a, b)
        med = [statistics.median(x[k] for x in splits) * 1e6 for k in range(3)]
        g, c = statistics.median(gpu), statistics.median(contig)
        print(f"{frag:4.2f}  {len(lengths):6d}  {total / 1e6:7.0f}  {med[0]:8.1f}  {med[1]:9.1f}  {med[2]:9.1f}  "
              f"{statistics.median(cpu) * 1e6 / args.step:10.1f}  {g:6.3f}  {total / g / 1e6:5.0f}  "
              f"{total / c / 1e6:11.0f}  {c / g:7.2f}  {bad}")


if __name__ == "__main__":
    main()
