"""A prefill engine of two TP ranks (two processes) serving one decode rank over NIXL.

Every rank of a multi-rank producer engine needs three things from whoever launches the engine:
  - the same engine id and incarnation on every rank (the ticket names the engine by them);
  - every rank's side-channel address, in rank order (``set_engine_addresses``), before the
    first ``hold``: the ticket lists them, so a consumer can reach each rank it reads from;
  - one nonce per request: rank 0 draws it in its ``hold``, every other rank holds the same
    request with ``nonce=ticket.nonce`` and so issues the identical ticket.
Each rank holds the request with the same block ids. The decode rank (TP 1) reads half of the
state and of the KV heads from each prefill rank and notifies both.

Run from the repository root: .venv/bin/python examples/multi_rank_producer.py
(three processes on this host, CPU memory, loopback; `bash scripts/setup.sh` creates .venv)
"""

import importlib.util
import multiprocessing as mp
import os
import secrets
import sys
import time
import uuid

try:
    from hybrid_transfer import Consumer, HybridCache, Producer, RankGeometry, load_preset, quiet_nixl_logging

    if importlib.util.find_spec("nixl") is None:  # imported by the three processes, not here
        raise ModuleNotFoundError(name="nixl")
except ModuleNotFoundError as exc:  # a Python without the project's packages (not .venv's)
    sys.exit(f"{exc.name} is not installed for {sys.executable}; run: "
             "bash scripts/setup.sh && .venv/bin/python examples/multi_rank_producer.py")

MODEL = load_preset("qwen3.5-0.8b")  # cache groups: 1 full-attention group, then 3 GDN groups
PREFILL_TP = 2
BLOCK_IDS = [[0], [1], [2], [3]]  # the same ids on every prefill rank
NUM_TOKENS = 500  # N-1 of a 501-token prompt: the decode side computes token 501 itself


def prefill_rank(rank, engine_id, incarnation, pipe):
    quiet_nixl_logging()  # NIXL logs a line per agent at INFO otherwise
    cache = HybridCache.allocate(RankGeometry(MODEL, tp_size=PREFILL_TP, tp_rank=rank), num_blocks=8)
    producer = Producer(cache, engine_id=engine_id, incarnation=incarnation)
    pipe.send(producer.address)
    producer.set_engine_addresses(pipe.recv())  # every rank's address, index == tp_rank
    # ... the prefill step writes this rank's shard into blocks 0-3, then: pin them
    nonce = pipe.recv()  # None on rank 0, which draws it; rank 0's nonce on every other rank
    pipe.send(producer.hold("req-1", BLOCK_IDS, num_tokens=NUM_TOKENS, nonce=nonce))
    while not producer.poll():  # frees the blocks once the decode rank reports its reads done
        time.sleep(0.001)
    producer.close()


def decode_rank(pipe):
    quiet_nixl_logging()
    consumer = Consumer(HybridCache.allocate(RankGeometry(MODEL, tp_size=1), num_blocks=8))
    ticket = pipe.recv()
    consumer.start_read(ticket, [[4], [5], [6], [7]], expected_state_position=NUM_TOKENS)
    while not (results := consumer.poll()):  # handshake with both ranks, two READs, two notifications
        time.sleep(0.001)
    print(results[0].state.value, results[0].num_bytes, "bytes from", ticket.tp_size, "prefill ranks")
    consumer.close()


if __name__ == "__main__":
    os.environ.setdefault("HYBRID_TRANSFER_SECRET", secrets.token_hex(32))  # one secret for all three ranks
    ctx = mp.get_context("spawn")
    engine_id, incarnation = f"prefill-{uuid.uuid4().hex[:6]}", int.from_bytes(os.urandom(6), "little")
    pipes, procs = [], []
    for rank in range(PREFILL_TP):
        ours, theirs = ctx.Pipe()
        pipes.append(ours)
        procs.append(ctx.Process(target=prefill_rank, args=(rank, engine_id, incarnation, theirs)))
    to_decode, decode_end = ctx.Pipe()
    procs.append(ctx.Process(target=decode_rank, args=(decode_end,)))
    for p in procs:
        p.start()
    addresses = [pipe.recv() for pipe in pipes]
    for pipe in pipes:
        pipe.send(addresses)
    pipes[0].send(None)
    ticket = pipes[0].recv()  # rank 0 draws the nonce
    for pipe in pipes[1:]:
        pipe.send(ticket.nonce)
        if pipe.recv() != ticket:
            raise SystemExit("a prefill rank issued a different ticket")
    to_decode.send(ticket)
    for p in procs:
        p.join()
