"""The read transport seam on CPU hosts (issue 28): NIXL and a shared-memory mapping of the producer's
cache move the same verified bytes, and faults end alike on both, with no copy once a mapping is invalid.

Real parts only: producer and consumer ranks in separate worker processes (harness.py), real NIXL agents
for the handshake, notifications and the NIXL path, and for the mapped path real named shared memory
(the producer's cache, HybridCache.allocate(shared=True)) mapped read-only into the consumer process.
The mapped path needs a shared secret (a handle goes only inside an authenticated handshake), so every
run here sets one on both sides, and the NIXL runs too, so the two runs differ only in the transport.
"""

from __future__ import annotations

import numpy as np
import pytest
from batch_ops import cache_digest
from harness import TINY, RankSpec, hold_everywhere, start_consumers, start_producers
from mapped_ops import transports

from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.layout import CacheOptions, KVLayout
from hybrid_transfer.verify import make_requests

NUM_BLOCKS = 48
TOKEN_COUNTS = [37, 64, 1, 0, 100]
PAIRS = {  # (prefill TP, decode TP, producer options, consumer options): fan-out, fan-in, block sizes apart
    "1->1": (1, 1, None, None),
    "2->4": (2, 4, None, CacheOptions(block_size=32)),
    "4->2": (4, 2, CacheOptions(block_size=32, kernel_block_size=16), None),
}
LAYOUTS = {"interleaved": None, "split": KVLayout.SPLIT}


def _with_layout(options, layout):
    if layout is None:
        return options
    return CacheOptions(kv_layout=layout) if options is None else CacheOptions(
        **{**{f: getattr(options, f) for f in options.__struct_fields__}, "kv_layout": layout})


def _run(cluster, secret_file, pair, layout, transport, device="cpu"):
    """Move every request of TOKEN_COUNTS over ``transport``; the consumers' transports and cache digests."""
    p_tp, c_tp, p_opts, c_opts = PAIRS[pair]
    p_opts, c_opts = _with_layout(p_opts, LAYOUTS[layout]), _with_layout(c_opts, LAYOUTS[layout])
    p_specs = [RankSpec(TINY, p_tp, r, NUM_BLOCKS, p_opts, shared=device == "cpu", device=device)
               for r in range(p_tp)]
    c_specs = [RankSpec(TINY, c_tp, r, NUM_BLOCKS, c_opts, device=device) for r in range(c_tp)]
    workers = cluster.workers
    producers = start_producers(workers[:p_tp], p_specs, EngineConfig(secret_file=secret_file))
    consumers = start_consumers(workers[p_tp:p_tp + c_tp], c_specs,
                                EngineConfig(secret_file=secret_file, read_transport=transport))
    try:
        rng = np.random.default_rng(7)
        remote = make_requests(p_specs[0].geometry(), TOKEN_COUNTS, NUM_BLOCKS, rng, 1.0, 0)
        local = make_requests(c_specs[0].geometry(), TOKEN_COUNTS, NUM_BLOCKS, rng, 1.0, 1)
        ids = [f"m-{i}" for i in range(len(TOKEN_COUNTS))]
        tickets = [hold_everywhere(producers, rid, lay, seed=500 + i)
                   for i, (rid, lay) in enumerate(zip(ids, remote, strict=True))]
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            for t, lay in zip(tickets, local, strict=True):
                w.call("start_read", k, t, lay.block_ids, lay.num_tokens)
        seen = []
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            results = w.call("wait_done", k, ids, 60.0)
            assert [r.state for r in results] == ["done"] * len(ids), results
            w.call("check", k, [(lay, 500 + i) for i, lay in enumerate(local)])  # the oracle: pattern and poison
            seen.append((w.call("call", transports, k), w.call("call", cache_digest, k)))
        for w, k in zip(producers.workers, producers.keys, strict=True):
            assert w.call("wait_freed", k, ids, 30.0) == sorted(ids)
        return seen
    finally:
        producers.close()
        consumers.close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pair", list(PAIRS))
def test_nixl_and_shared_memory_move_identical_verified_bytes(cluster, secret_file, pair, layout):
    identical_bytes_case(cluster, secret_file, pair, layout, "cpu", "shm")


def identical_bytes_case(cluster, secret_file, pair, layout, device, kind):
    over_nixl = _run(cluster, secret_file, pair, layout, "nixl", device)
    mapped = _run(cluster, secret_file, pair, layout, "mapped", device)
    for (t_nixl, digest_nixl), (t_map, digest_map) in zip(over_nixl, mapped, strict=True):
        assert digest_map == digest_nixl  # every byte of every consumer cache, poison included
        assert set(t_nixl["links"].values()) == {"nixl"} and not t_nixl["reads"].get(kind)
        assert set(t_map["links"].values()) == {kind} and t_map["reads"].get("nixl", 0) == 0
        assert t_map["reads"][kind] > 0 and t_map["bytes"][kind] == t_nixl["bytes"]["nixl"]
        assert t_map["metrics_transports"] == {kind: len(t_map["links"])}
