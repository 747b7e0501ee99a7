"""Where a READ's CPU time goes inside NIXL, per request: which call costs what, per descriptor count.

Two spawned processes, one NIXL agent each (raw ``nixl._api``, progress thread off, UCX created
through ``create_backend``): the target registers one buffer and is polled (``get_new_notifs``)
until told to stop; the initiator registers its own buffer and READs ``N`` descriptors of
``--total-bytes / N`` bytes (rounded down to 4 KiB) at shuffled, non-adjacent offsets on both
sides, so NIXL cannot merge them. Per request, median over ``--reps`` after warm-up, in ms:

  descs    both ``get_xfer_descs`` calls (Nx3 numpy -> descriptor lists)
  init     ``initialize_xfer`` (direct) or ``make_prepped_xfer`` with int32 indices (prepped-peer)
  post     ``transfer``
  done     ``transfer`` returned -> ``check_xfer_state`` says DONE (spinning)
  release  ``release_xfer_handle``

Strategies:
  direct        what the engine's ``PrepStrategy.DIRECT`` does: get_xfer_descs x2 + initialize_xfer + transfer
  prepped-peer  ``prep_xfer_dlist`` once per side over the whole buffer in entries of the descriptor size
                (its time is ``prep``), then per request make_prepped_xfer + transfer
  repost        one handle created once, ``transfer`` of the same handle again after each DONE

each with the UCX backend created with its thread pool (num_threads=4, split_batch_size=16: the
engine's GPU defaults) and without (no parameters). Also recorded once per backend: one
``get_new_notifs()`` with nothing pending, and one ``check_xfer_state`` of a DONE handle.

Run on the GPU host (one H200; both processes on cuda:0, UCX cuda_ipc):
  python benchmarks/post_cost.py --device cuda --json out/post_cost.json
On this CPU host (a smoke run, under a minute):
  python benchmarks/post_cost.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time

import numpy as np

COUNTS = (1, 2, 16, 75, 120, 240)
QUICK_COUNTS = (1, 16, 75)
BACKENDS = (("pool", {"num_threads": "4", "split_batch_size": "16"}), ("none", {}))
STRATEGIES = ("direct", "prepped-peer", "repost")
STEPS = ("descs", "init", "post", "done", "release")
ALIGN = 4096


def _agent(name: str, params: dict[str, str]):
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", params)
    return agent


def _buffer(device: str, nbytes: int):
    """One registered-to-be tensor; (tensor, base address, memory type)."""
    import torch

    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    tensor = torch.zeros(nbytes, dtype=torch.uint8, device=dev)
    return tensor, tensor.data_ptr(), "VRAM" if device == "cuda" else "DRAM"


def _register(agent, base: int, nbytes: int, mem: str):
    return agent.register_memory(agent.get_reg_descs([(base, nbytes, 0, "")], mem))


def _target(conn, device: str, buffer_bytes: int) -> None:
    """Register one buffer, hand out metadata and its address, progress until the pipe says stop."""
    tensor, base, mem = _buffer(device, buffer_bytes)
    agent = _agent(f"postcost-target-{os.getpid()}", {})
    reg = _register(agent, base, buffer_bytes, mem)
    conn.send((agent.get_agent_metadata(), base))
    while not conn.poll(0):
        agent.get_new_notifs()
        time.sleep(0.0005)
    conn.recv()
    agent.deregister_memory(reg)
    del tensor


READ_TIMEOUT_S = 60.0  # a READ still in PROC after this is reported, not waited on forever


def _wait_done(agent, handle, state: str) -> None:
    deadline = time.monotonic() + READ_TIMEOUT_S
    while state == "PROC":
        if time.monotonic() > deadline:
            raise RuntimeError(f"READ still in PROC after {READ_TIMEOUT_S} s")
        state = agent.check_xfer_state(handle)
    if state != "DONE":
        raise RuntimeError(f"READ ended in {state}")


def _median_ms(samples: list[int]) -> float:
    return statistics.median(samples) / 1e6


def _layout(n: int, total_bytes: int, buffer_bytes: int, seed: int) -> tuple[int, np.ndarray]:
    """Descriptor size and ``n`` entry indices (every other entry, shuffled) of a buffer cut into that size."""
    size = total_bytes // n // ALIGN * ALIGN
    if size == 0:
        raise ValueError(f"total_bytes {total_bytes} is too small for {n} descriptors of at least {ALIGN} bytes")
    if 2 * n * size > buffer_bytes:
        raise ValueError(f"{n} non-adjacent descriptors of {size} bytes do not fit a {buffer_bytes}-byte buffer")
    return size, (2 * np.random.default_rng(seed).permutation(n)).astype(np.int32)


def _descs(base: int, size: int, entries: np.ndarray) -> np.ndarray:
    rows = np.empty((entries.shape[0], 3), dtype=np.int64)
    rows[:, 0] = base + entries.astype(np.int64) * size
    rows[:, 1] = size
    rows[:, 2] = 0
    return rows


def _post_to_release(agent, handle) -> tuple[int, int, int]:
    """ns of ``transfer``, of transfer returned -> DONE, and of ``release_xfer_handle`` for one created handle."""
    t0 = time.perf_counter_ns()
    state = agent.transfer(handle)
    t1 = time.perf_counter_ns()
    _wait_done(agent, handle, state)
    t2 = time.perf_counter_ns()
    agent.release_xfer_handle(handle)
    return t1 - t0, t2 - t1, time.perf_counter_ns() - t2


def _timed(create, steps: tuple[str, ...], agent, reps: int, warmup: int) -> dict:
    """Medians (ms) of ``steps``: ``create()`` returns (handle, ns of each creation step), then post/done/release."""
    t = {s: [] for s in steps}
    for i in range(warmup + reps):
        handle, created = create()
        if i >= warmup:
            for step, ns in zip(steps, (*created, *_post_to_release(agent, handle)), strict=True):
                t[step].append(ns)
        else:
            _post_to_release(agent, handle)
    return {s: _median_ms(v) for s, v in t.items()}


def _direct(agent, peer, mem, local, remote, reps, warmup) -> dict:
    def create():
        t0 = time.perf_counter_ns()
        ld, rd = agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem)
        t1 = time.perf_counter_ns()
        handle = agent.initialize_xfer("READ", ld, rd, peer)
        return handle, (t1 - t0, time.perf_counter_ns() - t1)

    return _timed(create, STEPS, agent, reps, warmup)


def _prepped_peer(agent, peer, mem, lbase, rbase, buffer_bytes, size, li, ri, reps, warmup) -> dict:
    entries = np.arange(buffer_bytes // size, dtype=np.int32)
    t0 = time.perf_counter_ns()
    local_h = agent.prep_xfer_dlist("", _descs(lbase, size, entries), mem)
    remote_h = agent.prep_xfer_dlist(peer, _descs(rbase, size, entries), mem)
    prep_ns = time.perf_counter_ns() - t0

    def create():
        t1 = time.perf_counter_ns()
        handle = agent.make_prepped_xfer("READ", local_h, li, remote_h, ri)
        return handle, (time.perf_counter_ns() - t1,)

    medians = _timed(create, STEPS[1:], agent, reps, warmup)
    agent.release_dlist_handle(local_h)
    agent.release_dlist_handle(remote_h)
    return {"prep": prep_ns / 1e6, "entries": int(entries.shape[0]), **medians}


def _repost(agent, peer, mem, local, remote, reps, warmup) -> dict:
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peer)
    post, done = [], []
    for i in range(warmup + reps):
        t0 = time.perf_counter_ns()
        state = agent.transfer(handle)
        t1 = time.perf_counter_ns()
        _wait_done(agent, handle, state)
        t2 = time.perf_counter_ns()
        if i >= warmup:
            post.append(t1 - t0)
            done.append(t2 - t1)
    agent.release_xfer_handle(handle)
    return {"post": _median_ms(post), "done": _median_ms(done)}


def _once(agent, peer, mem, local, remote, calls: int = 1000) -> dict:
    """One empty ``get_new_notifs`` and one ``check_xfer_state`` of a DONE handle, median over ``calls``."""
    notifs, checks = [], []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        agent.get_new_notifs()
        notifs.append(time.perf_counter_ns() - t0)
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem), agent.get_xfer_descs(remote, mem), peer)
    _wait_done(agent, handle, agent.transfer(handle))
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        state = agent.check_xfer_state(handle)
        checks.append(time.perf_counter_ns() - t0)
        if state != "DONE":
            raise RuntimeError(f"a DONE handle reads {state}")
    agent.release_xfer_handle(handle)
    return {"get_new_notifs_ms": _median_ms(notifs), "check_done_ms": _median_ms(checks)}


def _initiator(conn, device: str, buffer_bytes: int, total_bytes: int, counts, reps: int, warmup: int) -> None:
    metadata, rbase = conn.recv()
    tensor, lbase, mem = _buffer(device, buffer_bytes)
    rows, once = [], {}
    for label, params in BACKENDS:
        agent = _agent(f"postcost-init-{label}-{os.getpid()}", params)
        reg = _register(agent, lbase, buffer_bytes, mem)
        peer = agent.add_remote_agent(metadata)
        peer = peer.decode() if isinstance(peer, bytes) else str(peer)
        for n in counts:
            size, li = _layout(n, total_bytes, buffer_bytes, seed=n)
            _, ri = _layout(n, total_bytes, buffer_bytes, seed=n + 1000)
            local, remote = _descs(lbase, size, li), _descs(rbase, size, ri)
            base = {"device": device, "threads": label, "backend_params": params, "descriptors": n,
                    "descriptor_bytes": size, "reps": reps}
            for strategy in STRATEGIES:
                if strategy == "direct":
                    got = _direct(agent, peer, mem, local, remote, reps, warmup)
                elif strategy == "prepped-peer":
                    got = _prepped_peer(agent, peer, mem, lbase, rbase, buffer_bytes, size, li, ri, reps, warmup)
                else:
                    got = _repost(agent, peer, mem, local, remote, reps, warmup)
                row = {**base, "strategy": strategy, **got}
                rows.append(row)
                conn.send(("row", row))
            if n == counts[0]:
                once[label] = _once(agent, peer, mem, local, remote)
        agent.remove_remote_agent(peer)
        agent.deregister_memory(reg)
        del agent
    conn.send(("end", {"rows": rows, "once": once}))
    del tensor


def _fmt(row: dict, key: str) -> str:
    return f"{row[key]:8.3f}" if key in row else f"{'-':>8}"


def _print_row(row: dict) -> None:
    create_post = sum(row.get(k, 0.0) for k in ("descs", "init", "post"))
    extra = f"  prep {row['prep']:.3f} ms over {row['entries']} entries" if "prep" in row else ""
    print(f"{row['strategy']:>12} {row['threads']:>5} {row['descriptors']:>5} {row['descriptor_bytes'] / 2**20:>9.2f}"
          + "".join(f" {_fmt(row, k)}" for k in STEPS) + f" {create_post:12.3f}{extra}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--total-bytes", type=int, default=None,
                        help="bytes per request (default 444 MB on cuda, 64 MB on cpu)")
    parser.add_argument("--buffer-bytes", type=int, default=None,
                        help="registered bytes per side (default 1 GiB on cuda, 256 MiB on cpu)")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--counts", default=None, help="comma-separated descriptor counts (default 1,2,16,75,120,240)")
    parser.add_argument("--quick", action="store_true", help="counts 1,16,75 and 5 reps: a smoke run")
    parser.add_argument("--json", default=None, help="write rows and the once-measured calls here")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda:
        os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # no per-agent INFO lines between the table's rows
    total = args.total_bytes or (444_000_000 if cuda else 64_000_000)
    buffer_bytes = args.buffer_bytes or (2**30 if cuda else 2**28)
    counts = tuple(int(c) for c in args.counts.split(",")) if args.counts else (QUICK_COUNTS if args.quick else COUNTS)
    reps = 5 if args.quick and args.reps == 30 else args.reps
    for n in counts:  # refuse a bad shape before any process starts
        _layout(n, total, buffer_bytes, seed=0)

    ctx = mp.get_context("spawn")
    t_conn, t_child = ctx.Pipe()
    i_conn, i_child = ctx.Pipe()
    target = ctx.Process(target=_target, args=(t_child, args.device, buffer_bytes), daemon=True)
    target.start()
    initiator = ctx.Process(target=_initiator, args=(i_child, args.device, buffer_bytes, total, counts, reps,
                                                     args.warmup), daemon=True)
    initiator.start()
    t_child.close()  # a child that dies then shows here as EOFError, not a hang
    i_child.close()
    print(f"{args.device}: {total / 1e6:.1f} MB per request, {buffer_bytes / 2**20:.0f} MiB registered per side, "
          f"median of {reps} reps after {args.warmup} warm-up; times in ms")
    print("pool: UCX thread pool (num_threads 4, split_batch_size 16) or none; '-': not a step of that strategy")
    print(f"{'strategy':>12} {'pool':>5} {'N':>5} {'desc MiB':>9}" + "".join(f" {k:>8}" for k in STEPS)
          + f" {'create+post':>12}")
    try:
        i_conn.send(t_conn.recv())
        while True:
            kind, payload = i_conn.recv()
            if kind == "row":
                _print_row(payload)
            else:
                break
    finally:
        t_conn.send(None)
        target.join(timeout=30)
        initiator.join(timeout=30)
    for label, once in payload["once"].items():
        print(f"once, thread pool {label}: get_new_notifs (nothing pending) {once['get_new_notifs_ms'] * 1e3:.1f} us, "
              f"check_xfer_state (DONE) {once['check_done_ms'] * 1e3:.1f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"total_bytes": total, "buffer_bytes": buffer_bytes, "warmup": args.warmup, **payload}, fh,
                      indent=1)


if __name__ == "__main__":
    main()
