"""Pages written by vLLM's own CPU attention kernel arrive whole, for every token count (no engine start).

The prefill process writes K and V of ``n`` tokens with vLLM's ``cpu_attn_reshape_and_cache`` for this
host's ISA, into our cache's attention pages viewed exactly as vLLM's CPU backend views them; the decode
process reads them over NIXL with the plan our geometry gives and checks every byte the kernel wrote
(found by writing into zeroed pages: the kernel decides where a token's bytes go, not our formula). The
negative control plans the same read as a token-major interior, which is what the connector assumed
before wire version 9: the kernel's bytes do not all arrive.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets
import time

import pytest
from tiny_weights import CONFIG

BLOCK = 128
COUNTS = (1, 5, BLOCK - 1, BLOCK + 3, 2 * BLOCK)
NUM_BLOCKS = 4 * len(COUNTS)
LAYER = 0


def _isa() -> str:
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(torch.bfloat16, BLOCK, CONFIG["head_dim"])


def _geometry(interior: str):
    from hybrid_transfer import RankGeometry
    from hybrid_transfer.layout import CacheOptions, model_from_config

    cfg = {k: CONFIG[k] for k in ("num_key_value_heads", "head_dim")}
    model = model_from_config({**cfg, "num_hidden_layers": 1, "layer_types": ["full_attention"],
                               "dtype": "bfloat16"}, name="kernel-pages")
    return RankGeometry(model, 1, 0, CacheOptions(block_size=BLOCK, kernel_block_size=BLOCK, kv_interior=interior))


def _vllm_view(cache):
    """K and V caches of layer 0 as vLLM's CPU backend hands them to its kernels."""
    kv = cache.kv(LAYER)  # [blocks, heads, tokens, 2*head_dim], vLLM's LBHNC tensor
    blocks, heads, tokens, _ = kv.shape
    return kv.view(blocks, heads, 2 * tokens, -1).chunk(2, dim=2)


def _blocks(i: int, n: int, side: int) -> list[int]:
    """Request i's blocks on one side (0 prefill, 1 decode), in an order that is not the identity."""
    return [4 * i + 2 + side, 4 * i + side][: -(-n // BLOCK)]


def _prefill(pipe, interior: str) -> None:
    import torch
    from vllm import _custom_ops as ops

    from hybrid_transfer import HybridCache, Producer

    torch.manual_seed(0)
    cache = HybridCache.allocate(_geometry(interior), NUM_BLOCKS)
    producer = Producer(cache)
    heads, dim = CONFIG["num_key_value_heads"], CONFIG["head_dim"]
    key_cache, value_cache = _vllm_view(cache)
    sent = []
    for i, n in enumerate(COUNTS):
        blocks = _blocks(i, n, 0)
        key = (torch.rand(n, heads, dim) + 0.5).to(torch.bfloat16)  # never 0: a written element is nonzero
        value = (torch.rand(n, heads, dim) + 0.5).to(torch.bfloat16)
        slots = torch.tensor([blocks[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)], dtype=torch.int64)
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, _isa())
        sent.append((producer.hold(f"req-{i}", [blocks], num_tokens=n), cache.kv(LAYER)[blocks].clone()))
    pipe.send(sent)
    done: set[str] = set()
    deadline = time.monotonic() + 120
    while len(done) < len(COUNTS) and time.monotonic() < deadline:
        done.update(producer.poll())
        time.sleep(0.001)
    producer.close()


def _decode(pipe, interior: str, out) -> None:

    from hybrid_transfer import Consumer, HybridCache

    cache = HybridCache.allocate(_geometry(interior), NUM_BLOCKS)
    for t in cache.tensors:
        t.fill_(0x5A)  # stale bytes of an earlier request
    sent = pipe.recv()
    consumer = Consumer(cache)
    for i, (ticket, _) in enumerate(sent):
        consumer.start_read(ticket, [_blocks(i, ticket.num_tokens, 1)], expected_state_position=ticket.num_tokens)
    states: dict[str, str] = {}
    deadline = time.monotonic() + 120
    while len(states) < len(sent) and time.monotonic() < deadline:
        states.update({r.request_id: r.state.value for r in consumer.poll()})
        time.sleep(0.001)
    report = {}
    for i, (ticket, written) in enumerate(sent):
        got = cache.kv(LAYER)[_blocks(i, ticket.num_tokens, 1)]
        kernel_bytes = written != 0  # where vLLM's kernel put the request's tokens
        report[ticket.num_tokens] = {
            "state": states.get(ticket.request_id, "none"), "kernel_bytes": int(kernel_bytes.sum()),
            "missing": int((got[kernel_bytes] != written[kernel_bytes]).sum())}
    out.put(report)
    consumer.close()


def transfer(interior: str) -> dict[int, dict]:
    """Every count of COUNTS moved once between two processes, each its own NIXL agent."""
    os.environ.setdefault("HYBRID_TRANSFER_SECRET", secrets.token_hex(32))
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = ctx.Queue()
    procs = [ctx.Process(target=_prefill, args=(a, interior)), ctx.Process(target=_decode, args=(b, interior, out))]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()


@pytest.fixture(scope="module")
def opaque():
    return transfer(f"CPU_ATTN:{_isa()}")


@pytest.mark.parametrize("n", COUNTS)
def test_every_byte_the_kernel_wrote_arrives(opaque, n):
    got = opaque[n]
    assert got["state"] == "done" and got["kernel_bytes"] > 0
    assert got["missing"] == 0, got


def test_a_token_major_plan_of_the_same_pages_loses_kernel_bytes():
    """The parent's assumption, as a control: it must lose bytes, or this file proves nothing on this host."""
    got = transfer("token-major")
    assert all(r["state"] == "done" for r in got.values())
    partial = [n for n in COUNTS if n % BLOCK]
    assert all(got[n]["missing"] > 0 for n in partial), got
    assert got[2 * BLOCK]["missing"] == 0  # whole blocks were always exact
