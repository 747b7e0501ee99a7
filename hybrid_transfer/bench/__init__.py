"""The microbenchmark (docs/benchmarks.md): real transfers between one process per rank, against naive and the ceiling.

Modules, one job each:
  spec         BenchSpec: the validated run description (flags of `hybrid-transfer bench`)
  sizing       block pools, request layouts, ceiling slot sizes, memory estimate (pure)
  messages     the typed commands and replies coordinator and rank processes exchange (msgspec, strict)
  worker       a rank process: Producer or Consumer, ceiling agent, timed loops; one handler per command
  ceiling      single-descriptor READs between bare agents of the same processes, and their byte pattern
  coordinator  the parent: spawns ranks, drives phases, passes tickets and results over pipes as messages
  stats        timing records and the figures of a variant (percentiles, GB/s, ratios)
  report       JSON records and the summary table; plot: the PNG
"""

from hybrid_transfer.bench.coordinator import BenchResult, Coordinator, run_bench
from hybrid_transfer.bench.spec import BenchSpec, Device, Sweep, Variant

__all__ = ["BenchResult", "BenchSpec", "Coordinator", "Device", "Sweep", "Variant", "run_bench"]
