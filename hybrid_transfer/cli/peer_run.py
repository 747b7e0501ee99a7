"""`hybrid-transfer bench --peer vllm-nixl`: vLLM 0.33's NixlConnector beside ours (docs/benchmarks.md#vllm-nixl).

The run lives in integrations/vllm_peer (it imports vLLM); this module maps the bench's options onto
it and refuses, in one line, what it cannot do: no vLLM in this interpreter, or an option the peer
run does not take (it is TP1 -> TP1 on CPU DRAM, loopback).
"""

from __future__ import annotations

import argparse
import importlib.util

from hybrid_transfer.bench.spec import BenchSpec
from hybrid_transfer.errors import ConfigError, UnsupportedError

VLLM_NIXL = "vllm-nixl"
PEERS = (VLLM_NIXL,)
VLLM_ENV_COMMAND = ("PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 "
                    "$(bash scripts/vllm_env.sh)/bin/python -m hybrid_transfer bench --peer vllm-nixl")
_D = BenchSpec()
# Options whose non-default values the peer run cannot honour: (dest, default, why).
_FIXED = (
    ("prefill_tp", 1, "TP1 -> TP1 only"), ("decode_tp", 1, "TP1 -> TP1 only"),
    ("sweep", None, "no sweeps"), ("plot", None, "no plot"), ("allocation", _D.allocation, "vLLM's scheduler allocates"),
    ("transport", _D.transport, "the shell's UCX environment applies"),
    ("fragmentation", _D.fragmentation, "vLLM's scheduler allocates"),
    ("mode", _D.mode.value, "each connector runs its own defaults"), ("kv_dtype", None, "the model dtype"),
)


def vllm_importable() -> bool:
    try:
        return importlib.util.find_spec("vllm.config") is not None
    except ModuleNotFoundError:
        return False


def run_peer(args: argparse.Namespace) -> int:
    """Run the side-by-side for ``--peer``; print its table (and JSON with --json)."""
    bad = [f"--{dest.replace('_', '-')} ({why})" for dest, default, why in _FIXED
           if getattr(args, dest, default) not in (default, None)]
    if bad:
        raise ConfigError(f"--peer {args.peer} does not take: {', '.join(bad)}", field="peer", value=args.peer)
    if not vllm_importable():
        raise UnsupportedError(f"--peer {args.peer} needs vLLM 0.33, which this interpreter lacks; run it with the "
                               f"vLLM environment's python: {VLLM_ENV_COMMAND}")
    from hybrid_transfer.cli.output import emit_json, table_stream
    from hybrid_transfer.integrations.vllm_peer import PeerSpec, plain_table, run_side_by_side, to_json

    concurrency = args.concurrency
    spec = PeerSpec(preset=args.preset, tokens=args.tokens, concurrency=concurrency,
                    waves=max(1, -(-args.requests // concurrency)), warmup=max(1, -(-args.warmup // concurrency)),
                    rounds=args.rounds,
                    num_threads=args.backend_threads or 0, seed=args.seed, device=args.device).validate()
    results = run_side_by_side(spec)
    print(plain_table(spec, results), file=table_stream(args))
    emit_json(args, to_json(spec, results))
    return 0
