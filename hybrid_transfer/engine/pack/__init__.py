"""Pack mode in the engine: it executes the plan layer's pack plans, it models nothing itself.

What gets staged where (a producer rank's canonical layout) and which READ ranges a consumer
posts (``PackSourcePlan.read``) are planned in plan/stage_layout.py and plan/planner.py; `auto`
is decided there too (plan/cost.py, with the preset for this rank's memory or given figures). Here:

  steps      SourceStep: a source's step through the consumer's pack path, changed in one place
  reader     the consumer: per source a direct or a staged read (PackReader), pool, timings
  stager     the producer: gather at hold, tell consumer agents where the request is staged
  staging    bounded registered staging pools, one per rank
  gather_scatter  one index copy per list on CPU or CUDA (gather into and scatter out of staging)
  calibrate  auto's cost model at start: the memory's preset, given figures, or (opt-in) this rank's measured ones
"""
