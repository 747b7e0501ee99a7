"""vLLM 0.33's NixlConnector beside ours, same caches and requests, real NIXL (docs/benchmarks.md#vllm-nixl).

Both connectors run through vLLM's real Scheduler and model-runner connector code (prefill engine in
this process, decode engine in a spawned one, loopback UCX), over caches from vLLM's
``allocate_kv_cache`` of one KVCacheConfig from vLLM's planner for a local config.json of the preset
(no weights). Every wave's requests are loaded in one decode step; every request's valid bytes are
checked against the source; the run fails unless both connectors moved the same requests between
the same block ids with the same bytes. Connectors: vllm-nixl (vLLM's defaults: NIXL's progress
thread), hybrid (ours, our defaults: no progress thread), hybrid-progress (ours with NIXL's
progress thread, as vLLM's agent runs), hybrid-post (ours with the posting thread). The same UCX threads
(--threads) and environment for all. --device cuda puts both engines' caches on GPU 0 (the two processes share
it; UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y is set for both when unset) and needs vLLM's CUDA platform: leave
VLLM_TARGET_DEVICE unset there.

Run with the vLLM environment's python:

  PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 \\
      $(bash scripts/vllm_env.sh)/bin/python benchmarks/vllm_nixl_side_by_side.py [--tokens 1024] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    from hybrid_transfer.integrations.vllm_peer import PeerSpec, plain_table, run_side_by_side, same_requests, to_json
    from hybrid_transfer.integrations.vllm_peer.model import CONNECTORS, DEVICES

    d = PeerSpec()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default=d.preset)
    parser.add_argument("--tokens", type=int, default=d.tokens, help="tokens whose KV moves per request")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help="requests per wave (one decode step)")
    parser.add_argument("--waves", type=int, default=d.waves, help="timed waves")
    parser.add_argument("--warmup", type=int, default=d.warmup, help="untimed waves first")
    parser.add_argument("--rounds", type=int, default=d.rounds,
                        help="every connector once per round, the order rotating (host noise); medians over all waves")
    parser.add_argument("--threads", type=int, default=d.num_threads, help="UCX thread-pool threads, every agent")
    parser.add_argument("--connectors", default=",".join(CONNECTORS), help="comma-separated, run in this order")
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--device", choices=DEVICES, default=d.device,
                        help="where both engines' caches live (cuda: GPU 0 for both processes)")
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    spec = PeerSpec(preset=args.preset, tokens=args.tokens, concurrency=args.concurrency, waves=args.waves,
                    rounds=args.rounds, warmup=args.warmup, num_threads=args.threads, seed=args.seed,
                    connectors=tuple(c for c in args.connectors.split(",") if c), device=args.device).validate()
    results = run_side_by_side(spec)
    print(plain_table(spec, results))
    problems = same_requests(results)
    print("same requests, block ids and bytes for every connector:", "yes" if not problems else "NO")
    for line in problems:
        print("  " + line)
    if args.json:
        print(json.dumps(to_json(spec, results), indent=2))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
