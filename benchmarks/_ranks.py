"""Rank processes for the benchmarks that spawn producers (request_overhead.py, ucx_threads.py, post_to_done.py).

Each producer rank runs in a spawned process behind a pipe: it sends its address, takes the engine's
addresses when TP > 1, then answers ``(request_id, block_ids, tokens, nonce)`` with a ticket, and a ``Fill``
(the verify pattern written into its cache, for a consumer to check) with "filled", until it is sent
``None``. The scripts are run as ``python benchmarks/NAME.py``, so this folder is on ``sys.path``
(and a spawned child gets the parent's ``sys.path``).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass

ANSWER_POLL_S = 1.0  # how often a wait for a rank's answer checks that the rank is still alive


@dataclass(frozen=True)
class Fill:
    """A command for serve_holds: write hybrid_transfer.verify's pattern for each (RequestLayout, seed) pair."""

    requests: tuple


def geometry(preset: str, tp_size: int, tp_rank: int):
    from hybrid_transfer import RankGeometry, load_preset

    return RankGeometry(load_preset(preset), tp_size, tp_rank)


def blocks_for(geometry, tokens: int) -> int:
    """Blocks one request of ``tokens`` tokens takes on a rank: its attention blocks plus one per state group."""
    return sum(geometry.num_blocks_for_tokens(tokens) if g.kind.name == "ATTENTION" else 1
               for g in geometry.tensor_map.groups)


def device(name: str):
    import torch

    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def serve_holds(conn, producer, tp_size: int, hold=None, wait_s: float = 0.0, sleep_s: float = 0.0001) -> None:
    """A producer rank's loop: address out, engine addresses in (TP > 1), one ticket per hold command.

    ``hold(producer, request_id, block_ids, tokens, nonce)`` makes the ticket (default: ``producer.hold``);
    a ``Fill`` writes the verify pattern (verify.fill_source) into this rank's cache. Between commands the
    producer is polled, waiting ``wait_s`` on the pipe and sleeping ``sleep_s``.
    """
    conn.send(producer.address)
    if tp_size > 1:
        producer.set_engine_addresses(conn.recv())
    while True:
        if conn.poll(wait_s):
            command = conn.recv()
            if command is None:
                break
            if isinstance(command, Fill):
                from hybrid_transfer.verify import fill_source

                for layout, seed in command.requests:
                    fill_source(producer.cache, layout, seed)
                if producer.cache.tensors[0].is_cuda:
                    import torch

                    # Written before any READ of them: UCX's copies are not ordered after this stream's kernels.
                    torch.cuda.synchronize(producer.cache.tensors[0].device)
                conn.send("filled")
                continue
            request_id, block_ids, tokens, nonce = command
            if hold is None:
                conn.send(producer.hold(request_id, block_ids, tokens, nonce=nonce))
            else:
                conn.send(hold(producer, request_id, block_ids, tokens, nonce))
        producer.poll()
        if sleep_s:
            time.sleep(sleep_s)
    producer.close()


def spawn(target, args, daemon: bool = True):
    """A spawned process running ``target(conn, *args)``; (process, this end of the pipe)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(child, *args), daemon=daemon)
    proc.start()
    return proc, parent


def start_producers(target, tp_size: int, args, daemon: bool = True):
    """Spawn ``tp_size`` rank processes running ``target(conn, *args(rank))``; (``[(process, conn)]``, addresses).

    Each rank's address is collected, and every rank is sent the list when TP > 1.
    """
    producers = [spawn(target, args(rank), daemon=daemon) for rank in range(tp_size)]
    addresses = [answer(conn, proc) for proc, conn in producers]
    if tp_size > 1:
        for _, conn in producers:
            conn.send(addresses)
    return producers, addresses


def start_engines(target, engines: int, tp_size: int, args, daemon: bool = True):
    """As start_producers for ``engines`` engines at once, ``args(engine, rank)``; (``[ranks]``, rank-0 addresses).

    Every rank of every engine is spawned before any address is awaited, so the engines start side by side.
    """
    fleet = [[spawn(target, args(e, rank), daemon=daemon) for rank in range(tp_size)] for e in range(engines)]
    firsts = []
    for ranks in fleet:
        addresses = [answer(conn, proc) for proc, conn in ranks]
        if tp_size > 1:
            for _, conn in ranks:
                conn.send(addresses)
        firsts.append(addresses[0])
    return fleet, firsts


def answer(conn, proc):
    """The next message on ``conn``; a rank that died raises instead of leaving this process waiting forever."""
    try:
        while not conn.poll(ANSWER_POLL_S):
            if not proc.is_alive():
                raise RuntimeError(f"a rank process exited with code {proc.exitcode}")
        return conn.recv()
    except EOFError:  # the rank closed its end: it is exiting (its traceback is on stderr)
        proc.join(timeout=ANSWER_POLL_S)
        raise RuntimeError(f"a rank process closed its pipe and exited with code {proc.exitcode}") from None


def hold_everywhere(producers, request_id: str, block_ids, tokens: int):
    """Hold one request on every producer rank (rank 0 issues the ticket, the others hold under its nonce)."""
    proc0, conn0 = producers[0]
    conn0.send((request_id, block_ids, tokens, None))
    ticket = answer(conn0, proc0)
    for proc, conn in producers[1:]:
        conn.send((request_id, block_ids, tokens, ticket.nonce))
        answer(conn, proc)
    return ticket


def fill_engines(fleet, requests_per_engine) -> None:
    """Write the verify pattern of each engine's (RequestLayout, seed) pairs on every rank of it (each its shard).

    Every rank is sent its command before any answer is awaited, so the engines fill side by side.
    """
    for ranks, requests in zip(fleet, requests_per_engine, strict=True):
        command = Fill(tuple(requests))
        for _, conn in ranks:
            conn.send(command)
    for ranks in fleet:
        for proc, conn in ranks:
            answer(conn, proc)


def stop_producers(producers, timeout: float | None = None) -> None:
    for proc, conn in producers:
        conn.send(None)
        proc.join(timeout=timeout)
