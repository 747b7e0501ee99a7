"""vLLM 0.33's NixlConnector beside ours (integrations/vllm_peer): the same caches and requests, real NIXL.

Both connectors run through vLLM's real Scheduler and model-runner connector code, prefill in this
process and decode in a spawned one, over caches from vLLM's ``allocate_kv_cache`` of one
KVCacheConfig from vLLM's planner (qwen3.5-0.8b's cache shapes). The test asserts that both moved
the same requests between the same block ids with every valid byte equal to the source's, and
prints their worker-thread time per request and post -> DONE p50 without asserting them (speed
lives in benchmarks/vllm_nixl_side_by_side.py).

Nothing here is left to the host: the SSM state dtype is named (EngineShape.ssm_dtype; the side-by-side
runs the preset's float32, the byte check both dtypes), and the refusal test sets the free memory it
is judged against instead of reading this host's.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_transfer.errors import VerificationError
from hybrid_transfer.integrations.vllm_peer import PeerSpec, plain_table, run_side_by_side, same_requests
from hybrid_transfer.integrations.vllm_peer.bytes_check import compare
from hybrid_transfer.integrations.vllm_peer.engine import allocate, fill_pattern
from hybrid_transfer.integrations.vllm_peer.model import HYBRID, VLLM_NIXL, EngineShape, build_configs

PRESET = "qwen3.5-0.8b"
# vLLM's block for this model is 544 tokens with float32 SSM state, 288 with bfloat16: either way full blocks
# and a partial last one move.
TOKENS = 600


def _valid_bytes(kvc, num_tokens: int) -> int:
    """Bytes a request's N-1 tokens fill, from vLLM's specs alone: per-token K|V of every attention layer plus
    every GDN layer's state (its real shapes, not the padded page)."""
    import math

    import torch

    total = 0
    for group in kvc.kv_cache_groups:
        spec = group.kv_cache_spec
        if type(spec).__name__ == "MambaSpec":
            per_layer = sum(math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
                            for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True))
        else:
            per_layer = spec.page_size_bytes // spec.block_size * num_tokens
        total += per_layer * len(group.layer_names)
    return total


def test_both_connectors_move_identical_verified_caches(capsys):
    spec = PeerSpec(preset=PRESET, tokens=TOKENS, concurrency=2, waves=1, warmup=1, connectors=(VLLM_NIXL, HYBRID))
    results = run_side_by_side(spec)  # raises BenchError (with the VerificationError's text) on any bad byte

    assert [r.connector for r in results] == [VLLM_NIXL, HYBRID]
    assert same_requests(results) == []  # same prefill ids, decode ids, valid byte counts and digests
    _, kvc = build_configs(VLLM_NIXL, "kv_both", EngineShape(PRESET, TOKENS, num_blocks=16, max_num_seqs=2))
    for r in results:
        requests = r.request_map()
        assert len(requests) == spec.concurrency * spec.waves
        assert {nbytes for _, _, nbytes, _ in requests.values()} == {_valid_bytes(kvc, TOKENS)}
        assert len({digest for *_, digest in requests.values()}) == len(requests)  # each request its own bytes
    with capsys.disabled():
        print()
        print(plain_table(spec, results))
        for r in results:
            print(f"{r.connector}: decode worker thread {r.worker_ms:.3f} ms per request (both hooks; NIXL's calls "
                  f"{r.nixl_ms:.3f} ms of it), post -> DONE p50 {r.p50_ms:.2f} ms")


@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
def test_the_byte_check_names_a_changed_byte(ssm_dtype):
    """Negative control: one byte changed in a request's valid region fails the comparison, naming the layer."""
    shape = EngineShape(PRESET, TOKENS, num_blocks=8, max_num_seqs=1, ssm_dtype=ssm_dtype)
    _, kvc = build_configs(VLLM_NIXL, "kv_both", shape)
    mamba = [g.kv_cache_spec for g in kvc.kv_cache_groups if type(g.kv_cache_spec).__name__ == "MambaSpec"]
    assert mamba and {spec.dtypes[1] for spec in mamba} == {getattr(torch, ssm_dtype)}  # what vLLM resolved
    [block_size] = {g.kv_cache_spec.block_size for g in kvc.kv_cache_groups
                    if type(g.kv_cache_spec).__name__ != "MambaSpec"}
    num_pages = -(-TOKENS // block_size)
    assert num_pages > 1 and TOKENS % block_size  # full blocks and a partial last one
    source, copy = allocate(kvc), allocate(kvc)
    fill_pattern(source, 3)
    fill_pattern(copy, 3)
    ids, next_id = [], 1
    for g in kvc.kv_cache_groups:
        n = 1 if type(g.kv_cache_spec).__name__ == "MambaSpec" else num_pages
        ids.append(list(range(next_id, next_id + n)))
        next_id += n
    assert next_id <= shape.num_blocks
    nbytes, _ = compare(kvc, copy, ids, source, ids, TOKENS, "r")
    assert nbytes == _valid_bytes(kvc, TOKENS)
    name = next(n for g in kvc.kv_cache_groups if type(g.kv_cache_spec).__name__ != "MambaSpec"
                for n in g.layer_names)
    attention_group = next(i for i, g in enumerate(kvc.kv_cache_groups) if name in g.layer_names)
    last = ids[attention_group][-1]
    in_last = TOKENS - (num_pages - 1) * block_size  # the request's tokens in its partial last block
    raw = copy[name].view(torch.uint8)  # [blocks, heads, tokens, K|V bytes]
    raw[last, 0, in_last - 1, 0] ^= 0xFF  # the last valid token of the partial block
    with pytest.raises(VerificationError, match=name):
        compare(kvc, copy, ids, source, ids, TOKENS, "r")
    raw[last, 0, in_last - 1, 0] ^= 0xFF
    raw[last, 0, in_last, 0] ^= 0xFF  # the first position past the request's tokens: not compared
    assert compare(kvc, copy, ids, source, ids, TOKENS, "r")[0] == nbytes


def test_a_run_the_host_cannot_hold_is_refused_before_any_process_starts(monkeypatch):
    """Judged against a free-memory figure the test sets on both sides of the limit, not this host's memory
    (a host with a few hundred GiB free would hold this run)."""
    from hybrid_transfer.errors import ConfigError
    from hybrid_transfer.integrations.vllm_peer import side_by_side
    from hybrid_transfer.integrations.vllm_peer.side_by_side import CACHE_COPIES, MEMORY_SHARE, engine_shape

    spec = PeerSpec(preset=PRESET, tokens=131072, concurrency=64)
    free = {"bytes": 2**62}
    monkeypatch.setattr(side_by_side, "_free_memory", lambda device: [("this host's memory", CACHE_COPIES,
                                                                      free["bytes"])])
    shape = engine_shape(spec)  # room for it
    cache_bytes = sum(t.size for t in build_configs(VLLM_NIXL, "kv_both", shape)[1].kv_cache_tensors)
    need = CACHE_COPIES * cache_bytes / MEMORY_SHARE
    free["bytes"] = int(need) + 2
    assert engine_shape(spec) == shape
    free["bytes"] = int(need) - 2
    with pytest.raises(ConfigError, match="requests of 131072 tokens need 3 caches of .* GiB free"):
        engine_shape(spec)
