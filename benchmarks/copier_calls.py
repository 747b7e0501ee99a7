"""What each CUDA and Triton call inside ``RangeCopier.copy`` costs the worker thread (issue 28, fourth pass).

Not a test: run `python benchmarks/copier_calls.py` on a GPU host (PYTHONPATH as scripts/gpu_run.sh sets it).
Times each call alone, 2,000 times after 50 warm-ups, and prints microseconds per call: torch's stream
lookups and stream context against setting the stream directly, waiting on a stream against one reused
event, an event, the table's upload, a Triton launch, the chunk table, and a whole ``RangeCopier.copy`` of
100 ranges. Then it tries Triton's compiled-kernel launcher with a raw stream (printing the error where
this Triton's launcher wants other arguments). docs/benchmarks.md#issue-28-fourth.
"""

from __future__ import annotations

import time
import traceback

import numpy as np
import torch
import triton

from hybrid_transfer.engine.mapped import cuda_ipc

N = 2000


def timed(name: str, fn) -> None:
    for _ in range(50):
        fn()
    t0 = time.perf_counter()
    for _ in range(N):
        fn()
    print(f"{name:40s} {1e6 * (time.perf_counter() - t0) / N:8.2f} us", flush=True)


def main() -> None:
    dev = torch.device("cuda:0")
    torch.cuda.init()
    s = torch.cuda.Stream(device=dev)
    timed("current_stream(device obj)", lambda: torch.cuda.current_stream(dev))
    timed("current_stream(0)", lambda: torch.cuda.current_stream(0))
    timed("current_stream()", lambda: torch.cuda.current_stream())
    cur = torch.cuda.current_stream(0)
    timed("wait_stream", lambda: s.wait_stream(cur))
    ev = torch.cuda.Event()

    def wait_event():
        ev.record(cur)
        s.wait_event(ev)

    timed("record+wait_event (reused)", wait_event)
    timed("Event()", lambda: torch.cuda.Event())

    def context():
        with torch.cuda.stream(s):
            pass

    timed("with torch.cuda.stream", context)

    def set_twice():
        torch.cuda.set_stream(s)
        torch.cuda.set_stream(cur)

    timed("set_stream x2", set_twice)
    e2 = torch.cuda.Event()
    timed("event.record(s)", lambda: e2.record(s))
    timed("event.query()", lambda: e2.query())
    pinned = torch.empty(3 * 32768, dtype=torch.int64, pin_memory=True)
    pinned_np = pinned.numpy()
    table_dev = torch.empty(3 * 32768, dtype=torch.int64, device=dev)

    def upload():
        with torch.cuda.stream(s):
            table_dev[:300].copy_(pinned[:300], non_blocking=True)

    timed("ctx + H2D copy of 300 int64", upload)
    timed("slice pinned[:300]", lambda: pinned[:300])
    src = torch.empty(1 << 26, dtype=torch.uint8, device=dev)
    dst = torch.empty(1 << 26, dtype=torch.uint8, device=dev)
    kernel = cuda_ipc._kernel()
    n = 100
    offsets = np.arange(n, dtype=np.int64) * (1 << 18)
    table = cuda_ipc.chunk_table(dst.data_ptr() + offsets, src.data_ptr() + offsets, np.full(n, 1 << 18, np.int64))
    m = table.shape[1]
    pinned_np[:3 * m] = table.reshape(-1)
    table_dev[:3 * m].copy_(pinned[:3 * m])

    def launch():
        with torch.cuda.stream(s):
            kernel[(m,)](table_dev, m, BLOCK=1024, WIDTH=8)

    timed("ctx + triton launch", launch)
    timed("chunk_table 120 ranges", lambda: cuda_ipc.chunk_table(table[1][:120], table[0][:120], table[2][:120]))
    copier = cuda_ipc.RangeCopier(dev)
    print(f"the probe reads the table in place: {copier.table_in_place}")
    for in_place in (False, True):
        c = cuda_ipc.RangeCopier(dev, table_in_place=in_place)
        timed(f"RangeCopier.copy 100 ranges, table {'in place' if in_place else 'uploaded'}",
              lambda c=c: c.copy(table[1], table[0], table[2]))
    torch.cuda.synchronize()
    print("triton", triton.__version__, "torch", torch.__version__)
    try:
        with torch.cuda.stream(s):
            compiled = kernel[(m,)](table_dev, m, BLOCK=1024, WIDTH=8)
        raw = s.cuda_stream
        timed("compiled[(m,1,1)](..., stream=raw)", lambda: compiled[(m, 1, 1)](table_dev, m, stream=raw))
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - the launcher's signature is Triton's own, per version
        traceback.print_exc()


if __name__ == "__main__":
    main()
