"""Quick start: a prefill process holds a request's cache; a decode process reads it over NIXL.

Run from the repository root: .venv/bin/python examples/quickstart.py
(two processes on this host, CPU memory, loopback; `bash scripts/setup.sh` creates .venv)
"""

import importlib.util
import multiprocessing as mp
import os
import secrets
import sys
import time

try:
    from hybrid_transfer import Consumer, HybridCache, Producer, RankGeometry, load_preset

    if importlib.util.find_spec("nixl") is None:  # imported by the two processes, not here
        raise ModuleNotFoundError(name="nixl")
except ModuleNotFoundError as exc:  # a Python without the project's packages (not .venv's)
    sys.exit(f"{exc.name} is not installed for {sys.executable}; run: "
             "bash scripts/setup.sh && .venv/bin/python examples/quickstart.py")

MODEL = load_preset("qwen3.5-0.8b")  # cache groups: 1 full-attention group, then 3 GDN groups


def prefill(pipe):
    producer = Producer(HybridCache.allocate(RankGeometry(MODEL, tp_size=1), num_blocks=8))
    # ... the prefill step writes blocks 0-3, then: pin them and hand out a ticket
    pipe.send(producer.hold("req-1", [[0], [1], [2], [3]], num_tokens=500))
    while not producer.poll():  # frees the blocks once the decode side reports its reads done
        time.sleep(0.001)
    producer.close()


def decode(pipe):
    consumer = Consumer(HybridCache.allocate(RankGeometry(MODEL, tp_size=1), num_blocks=8))
    consumer.start_read(pipe.recv(), [[4], [5], [6], [7]], expected_state_position=500)
    while not (results := consumer.poll()):  # handshake, READs, completion notification
        time.sleep(0.001)
    print(results[0].state.value, results[0].num_bytes, "bytes")
    consumer.close()


if __name__ == "__main__":
    # One secret for both sides authenticates the handshake and the notifications (docs/security.md);
    # a deployment gives every engine the same one (HYBRID_TRANSFER_SECRET or EngineConfig.secret_file).
    os.environ.setdefault("HYBRID_TRANSFER_SECRET", secrets.token_hex(32))
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    procs = [ctx.Process(target=prefill, args=(a,)), ctx.Process(target=decode, args=(b,))]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
