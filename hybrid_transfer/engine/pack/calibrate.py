"""Auto mode's cost model at consumer start: the preset for the cache's memory, given figures, or a calibration.

By default a consumer plans ``auto`` with plan/cost.py's preset for its memory (GPU or host), so
every rank and every restart chooses the same way for a shape (docs/planner.md#auto). With
``EngineConfig.calibrate`` it measures its own figures instead, as below.

A short calibration of auto mode's cost model on this rank: READ and copy costs, measured.

Loopback READs (the agent reads its own staging pool: NIXL lets an agent name itself as the peer)
of one small descriptor, of one large one and of the same bytes as many small ones with gaps
between them (so nothing merges) give the per-byte and the per-descriptor cost; gathers from the
cache into staging of one piece and of many give the copy costs. Loopback is not the cross-process path (on CPU hosts it skips the
shared-memory transport), so an embedder that knows better passes ``EngineConfig.cost``.
About 0.1-0.5 s on a CPU host; the time and figures are logged. It cannot see pack's fixed share
(a Staged notification from another process), which it takes from the preset.
"""

from __future__ import annotations

import logging
import statistics
import time

import numpy as np

from hybrid_transfer.engine.agent import NixlAgent, XferState
from hybrid_transfer.engine.config import CostParams, EngineConfig
from hybrid_transfer.engine.pack.gather_scatter import Copier
from hybrid_transfer.engine.pack.staging import StagingPool
from hybrid_transfer.errors import ConfigError, EngineError
from hybrid_transfer.plan.cost import CostModel, preset_for

log = logging.getLogger(__name__)

PROBE_BYTES = 8 << 20
SMALL_BYTES = 4 << 10
REPEATS = 3
READ_TIMEOUT_S = 10.0
_MIN_COST_S = 1e-9


def cost_model(params: CostParams) -> CostModel:
    """The planner's cost model with these parameters (the gather is off the critical path)."""
    return CostModel(per_descriptor_s=params.per_descriptor_s, per_byte_s=params.per_byte_s,
                     copy_per_byte_s=params.copy_per_byte_s, per_piece_copy_s=params.per_piece_copy_s,
                     copy_launch_s=params.copy_launch_s, pack_fixed_s=params.pack_fixed_s, count_gather=False)


def initial_cost(config: EngineConfig, device_memory: bool) -> CostModel:
    """The model a consumer starts with: ``config.cost`` when given, else the preset for its memory."""
    return cost_model(config.cost) if config.cost is not None else preset_for(device_memory)


def calibrate(agent: NixlAgent, pool: StagingPool, copier: Copier, *, probe_bytes: int = PROBE_BYTES,
              small_bytes: int = SMALL_BYTES, repeats: int = REPEATS) -> CostParams:
    """Measure READ and copy costs between ``pool`` and itself and from the copier's cache into it.

    Raises:
        ConfigError: the pool cannot hold two probes of ``4 * small_bytes``.
        EngineError: a READ failed or did not finish within READ_TIMEOUT_S.
    """
    started = time.perf_counter()
    half = min(probe_bytes, pool.capacity_bytes // 2) // (4 * small_bytes) * (4 * small_bytes)
    src, dst = (pool.try_alloc(half) if half > 0 else None), (pool.try_alloc(half) if half > 0 else None)
    try:
        if src is None or dst is None:
            raise ConfigError(f"a staging pool of {pool.capacity_bytes} B is too small to calibrate in",
                              field="staging_bytes", value=pool.capacity_bytes)
        dev = pool.region.device_id
        nbytes = half // 2  # the same bytes as one descriptor and as many with gaps (the gaps need 2x)
        count = nbytes // small_bytes

        def read(offsets: np.ndarray, size: int) -> float:
            n = offsets.shape[0]
            local = np.stack([dst.addr + offsets, np.full(n, size), np.full(n, dev)], axis=1)
            remote = np.stack([src.addr + offsets, np.full(n, size), np.full(n, dev)], axis=1)
            return _read_s(agent, local, remote, repeats)

        zero = np.zeros(1, dtype=np.int64)
        tiny, one = read(zero, small_bytes), read(zero, nbytes)
        many = read(np.arange(count, dtype=np.int64) * 2 * small_bytes, small_bytes)
        per_byte = max(one - tiny, 0.0) / (nbytes - small_bytes) or one / nbytes
        per_desc = max((many - one) / (count - 1), _MIN_COST_S)  # never free, however noisy the host
        copy_byte, copy_piece, launch = _copy_costs(copier, dst, half, small_bytes, repeats)
    finally:
        for piece in (src, dst):
            if piece is not None:
                pool.free(piece)
    fixed = preset_for(pool.device.type == "cuda").pack_fixed_s
    params = CostParams(per_descriptor_s=per_desc, per_byte_s=per_byte, copy_per_byte_s=copy_byte,
                        per_piece_copy_s=copy_piece, copy_launch_s=launch, pack_fixed_s=fixed)
    log.info("calibrated in %.3f s: %s", time.perf_counter() - started, params)
    return params


def _read_s(agent: NixlAgent, local: np.ndarray, remote: np.ndarray, repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):  # the first READ also wires up the loopback: not timed
        t0 = time.perf_counter()
        handle = agent.post_read(agent.name, local.astype(np.int64), remote.astype(np.int64))
        deadline = t0 + READ_TIMEOUT_S
        try:
            while agent.check(handle) is XferState.PROC:
                if time.perf_counter() > deadline:
                    raise EngineError(f"calibration READ not done after {READ_TIMEOUT_S} s", operation="calibrate",
                                      agent=agent.name)
            if handle.state is not XferState.DONE:
                raise EngineError("calibration READ failed", operation="calibrate", agent=agent.name)
        finally:
            agent.release(handle)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _copy_costs(copier: Copier, dst, half: int, small: int, repeats: int) -> tuple[float, float, float]:
    """(per byte, per piece, launch) of gathers from the largest cache tensor into ``dst``."""
    base, size = copier.arena.largest()
    nbytes = min(half, size) // small * small
    if nbytes < 2 * small:
        return CostParams().copy_per_byte_s, CostParams().per_piece_copy_s, CostParams().copy_launch_s
    count = nbytes // small

    def timed(addr: np.ndarray, length: np.ndarray) -> float:
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            ticket = copier.gather(addr, length, dst.tensor)
            ticket.wait()
            times.append(max(ticket.elapsed_s, 0.0) or time.perf_counter() - t0)
        return statistics.median(times[1:])

    whole = timed(np.array([base]), np.array([nbytes]))
    pieces = timed(base + np.arange(count, dtype=np.int64)[::-1] * small, np.full(count, small))
    tiny = timed(np.array([base]), np.array([small]))
    return whole / nbytes, max(0.0, (pieces - whole) / (count - 1)), tiny
