"""The microbenchmark (docs/benchmarks.md): real transfers between one process per rank, against naive and the ceiling.

Modules, one job each:
  spec         BenchSpec: the validated run description (flags of `hybrid-transfer bench`)
  sizing       block pools, request layouts, ceiling slot sizes, memory estimate (pure)
  vllm_pool    --allocation vllm-pool: block ids from vLLM 0.33's shared block pool under a churn (pure)
  messages     the typed commands and replies coordinator and rank processes exchange (msgspec, strict)
  worker       a rank process: Producer or Consumer, ceiling agent, timed loops; one handler per command
  ceiling      single-descriptor READs between bare agents of the same processes, and their byte pattern
  coordinator  the parent: spawns ranks, drives phases, passes tickets and results over pipes as messages
  stats        timing records and the figures of a variant (percentiles, GB/s, ratios)
  report       JSON records and the summary table; plot: the PNG
"""

# Imported on first use: the coordinator pulls in torch (2-7 s on a busy host), which `bench --help`
# and a mistyped flag must not wait for (the CLI reads only spec's defaults).
_LAZY = {
    "BenchResult": "coordinator", "Coordinator": "coordinator", "run_bench": "coordinator",
    "BenchSpec": "spec", "Device": "spec", "Sweep": "spec", "Variant": "spec",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"hybrid_transfer.bench.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hybrid_transfer.bench' has no attribute {name!r}")
