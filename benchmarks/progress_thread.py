"""Who should progress NIXL? Throughput and CPU of a 2-process READ under each progress policy.

Two spawned processes, each with one engine NixlAgent (hybrid_transfer.engine.agent): a target
that registers a buffer and, like an embedder calling Producer.poll() once per engine step,
polls notifications every ``--target-poll-ms``; and an initiator that reads the buffer
``--reps`` times, checking the READ in a tight loop. Reported per policy:

  first_read_ms  the first READ to a new peer (connection set-up needs the target's progress)
  GB/s           median over the remaining reads, for large and for small descriptors
  init_cores / target_cores   CPU seconds / wall seconds of each process during the reads
  idle_cores     CPU of one idle agent (nothing posted) over one second

Run: python benchmarks/progress_thread.py [--json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

BUFFER_BYTES = 256 << 20
SMALL_BYTES = 16 << 10  # with a gap of the same size between descriptors


def _config(policy: str, delay_us: int):
    from hybrid_transfer.engine.config import EngineConfig, ProgressPolicy

    return EngineConfig(progress=ProgressPolicy(policy), progress_delay_us=delay_us)


def _descs(base: int, desc_bytes: int, stride: int, count: int) -> np.ndarray:
    out = np.zeros((count, 3), dtype=np.int64)
    out[:, 0] = base + np.arange(count, dtype=np.int64) * stride
    out[:, 1] = desc_bytes
    return out


def _target(conn, policy: str, delay_us: int, poll_ms: float) -> None:
    import torch

    from hybrid_transfer.cache import Region
    from hybrid_transfer.engine.agent import NixlAgent

    agent = NixlAgent(f"target-{os.getpid()}", _config(policy, delay_us))
    buf = torch.full((BUFFER_BYTES,), 7, dtype=torch.uint8)
    agent.register([Region(buf.data_ptr(), BUFFER_BYTES, 0)])
    conn.send((agent.metadata, buf.data_ptr()))
    cpu0, wall0 = time.process_time(), time.perf_counter()
    done = False
    while not done:
        for messages in agent.get_notifs().values():
            done = done or b"stop" in messages
        time.sleep(poll_ms / 1000)
    conn.send((time.process_time() - cpu0) / (time.perf_counter() - wall0))
    agent.close()


def _read_all(agent, peer, local: np.ndarray, remote: np.ndarray) -> float:
    t0 = time.perf_counter()
    xfer = agent.post_read(peer, local, remote)
    while agent.check(xfer).value == "PROC":
        pass
    if xfer.state.value != "DONE":
        raise RuntimeError(f"READ ended in {xfer.state}")
    agent.release(xfer)
    return time.perf_counter() - t0


def _initiator(conn, policy: str, delay_us: int, reps: int) -> None:
    import torch

    from hybrid_transfer.cache import Region
    from hybrid_transfer.engine.agent import NixlAgent

    agent = NixlAgent(f"init-{os.getpid()}", _config(policy, delay_us))
    buf = torch.zeros(BUFFER_BYTES, dtype=torch.uint8)
    agent.register([Region(buf.data_ptr(), BUFFER_BYTES, 0)])
    time.sleep(0.2)
    c0 = time.process_time()
    time.sleep(1.0)
    idle = time.process_time() - c0
    metadata, remote_base = conn.recv()
    peer = agent.add_remote(metadata)
    large = _descs(buf.data_ptr(), 16 << 20, 16 << 20, BUFFER_BYTES // (16 << 20))
    small = _descs(buf.data_ptr(), SMALL_BYTES, 2 * SMALL_BYTES, BUFFER_BYTES // (2 * SMALL_BYTES))
    out = {"idle_cores": idle}
    for name, local in (("large", large), ("small", small)):
        remote = local.copy()
        remote[:, 0] += remote_base - buf.data_ptr()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        times = [_read_all(agent, peer, local, remote) for _ in range(reps)]
        out[f"{name}_init_cores"] = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
        if name == "large":
            out["first_read_ms"] = times[0] * 1e3
        nbytes = int(local[:, 1].sum())
        out[f"{name}_GBps"] = nbytes / statistics.median(times[1:]) / 1e9
    if int(buf[0]) != 7:
        raise RuntimeError("the READ did not move the bytes")
    agent.send_notif(peer, b"stop")
    conn.send(out)
    agent.close()


def run(policy: str, delay_us: int, reps: int, poll_ms: float) -> dict:
    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(t_child, policy, delay_us, poll_ms))
    initiator = ctx.Process(target=_initiator, args=(i_child, policy, delay_us, reps))
    target.start()
    initiator.start()
    i_conn.send(t_conn.recv())
    result = i_conn.recv()
    result["target_cores"] = t_conn.recv()
    target.join()
    initiator.join()
    return {"policy": policy, "delay_us": delay_us, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--target-poll-ms", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    variants = [("off", 0), ("on", 0), ("on", 100), ("on", 1000)]
    rows = [run(p, d, args.reps, args.target_poll_ms) for p, d in variants]
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{'policy':>8} {'delay':>6} {'first ms':>9} {'large GB/s':>10} {'small GB/s':>10} "
          f"{'init cores':>10} {'target cores':>12} {'idle cores':>10}")
    for r in rows:
        print(f"{r['policy']:>8} {r['delay_us']:>6} {r['first_read_ms']:>9.1f} {r['large_GBps']:>10.2f} "
              f"{r['small_GBps']:>10.2f} {r['large_init_cores']:>10.2f} {r['target_cores']:>12.2f} "
              f"{r['idle_cores']:>10.2f}")


if __name__ == "__main__":
    main()
