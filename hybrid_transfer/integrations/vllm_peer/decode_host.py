"""The decode engine's process: its own step loop, as a vLLM engine core runs, commanded through a pipe.

The orchestrating process is the prefill engine; this one hosts one decode engine at a time (first
vLLM's connector, then ours: one vLLM import for both). A wave's requests are added together,
the engine steps until every one of them has its first token and its blocks are free, then every
request's valid bytes are checked against the source pattern (regenerated here from the seed) and
the wave's figures go back.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

from hybrid_transfer.errors import BenchError
from hybrid_transfer.integrations.vllm_peer.pipe import serve

WAVE_DEADLINE_S = 120.0
IDLE_POLL_S = 0.05


@dataclass(frozen=True)
class WaveRequest:
    request_id: str  # decode side id
    num_prompt_tokens: int
    params: dict  # kv_transfer_params from the prefill engine's output
    source_ids: tuple[tuple[int, ...], ...]  # the prefill request's ids per vLLM group (clipped)


@dataclass(frozen=True)
class RequestFigures:
    request_id: str
    post_s: float  # start_load_kv of the step that carried the load -> the report naming it
    block_ids: tuple[tuple[int, ...], ...]
    nbytes: int
    digest: str


@dataclass(frozen=True)
class WaveFigures:
    requests: tuple[RequestFigures, ...]
    start_s: float  # inside start_load_kv, every step of the wave
    results_s: float  # inside get_transfer_results, every step of the wave
    nixl_s: float  # of those, inside NIXL agent calls on the worker's thread
    descriptors: int  # local descriptors of the transfers the hooks created
    num_steps: int
    window_s: float  # first post -> last report
    cpu_s: float  # this process's CPU time over the wave


class _Host:
    def __init__(self):
        self.engine = None
        self.expected = None
        self.num_profiles = 0

    def create(self, connector: str, shape, seed: int) -> str:
        from hybrid_transfer.integrations.vllm_peer.engine import PeerEngine, allocate, fill_pattern

        self.close()
        self.engine = PeerEngine(connector, "kv_consumer", shape, seed=seed)
        # The source's bytes, from the same seed, in this host's memory whatever the device (compared there).
        self.expected = allocate(self.engine.kv_cache_config)
        fill_pattern(self.expected, seed)
        return self.engine.vllm_config.kv_transfer_config.engine_id

    def wave(self, requests: list[WaveRequest]) -> WaveFigures:
        from hybrid_transfer.integrations.vllm_peer.bytes_check import compare

        e = self.engine
        times = e.times
        first_step, first_result, nixl0, desc0 = len(times.start_s), len(times.results_s), times.nixl_s, times.descriptors
        ids = [r.request_id for r in requests]
        e.fence = set(ids)
        for r in requests:
            e.add(r.request_id, r.num_prompt_tokens, r.params)
        cpu0 = time.process_time()
        e.step()
        not_waiting = [rid for rid in ids if not e.is_waiting_for_kvs(rid)]
        if not_waiting:
            raise BenchError(f"requests {not_waiting} are not waiting for remote KVs after the first step",
                             where="decode")
        post_t = times.step_start_t[first_step]
        block_ids = {rid: tuple(tuple(g) for g in e.block_ids(rid)) for rid in ids}
        deadline = time.monotonic() + WAVE_DEADLINE_S
        while not e.is_idle():
            if time.monotonic() > deadline:
                missing = sorted(set(ids) - set(times.recv_t))
                raise BenchError(f"wave not done within {WAVE_DEADLINE_S} s; not received: {missing}", where="decode")
            e.step()
        cpu_s = time.process_time() - cpu0
        if times.failed & set(ids):
            raise BenchError(f"connector reported failed loads: {sorted(times.failed & set(ids))}", where="decode")
        figures = []
        for r in requests:
            nbytes, digest = compare(e.kv_cache_config, e.caches, block_ids[r.request_id], self.expected,
                                     r.source_ids, r.num_prompt_tokens - 1, r.request_id)
            figures.append(RequestFigures(r.request_id, times.recv_t[r.request_id] - post_t,
                                          block_ids[r.request_id], nbytes, digest))
        return WaveFigures(tuple(figures), sum(times.start_s[first_step:]), sum(times.results_s[first_result:]),
                           times.nixl_s - nixl0, times.descriptors - desc0, len(times.start_s) - first_step, max(times.recv_t[i] for i in ids) - post_t, cpu_s)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine, self.expected = None, None


def _call(host: _Host, op: str, args: tuple):
    """Run one command; with HT_PEER_PROFILE=PREFIX set, each wave's cProfile goes to PREFIX.<connector>.<n>."""
    prefix = os.environ.get("HT_PEER_PROFILE")
    if op != "wave" or not prefix:
        return getattr(host, op)(*args)
    import cProfile

    profile = cProfile.Profile()
    try:
        return profile.runcall(host.wave, *args)
    finally:
        host.num_profiles += 1
        profile.dump_stats(f"{prefix}.{host.engine.connector_name}.{host.num_profiles}")


def host_main(conn, env: dict[str, str]) -> None:
    """Entry of the spawned decode process: (op, args) in, ("ok", value) or ("err", text) out."""
    os.environ.update(env)
    logging.basicConfig(level=os.environ.get("HT_PEER_LOG", "WARNING"))
    import torch

    # One intra-op thread: the engine's thread and UCX's share a loaded host; torch's OpenMP pool of one
    # thread per core made our tail zeroing (128 KiB zero_ per layer) take 30 ms per request here while the
    # other core was busy. Neither connector's hooks gain from it.
    torch.set_num_threads(1)
    host = _Host()
    try:
        serve(conn, lambda op, args: _call(host, op, args), IDLE_POLL_S)
    finally:
        host.close()
