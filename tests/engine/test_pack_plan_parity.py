"""`hybrid-transfer plan --mode pack` describes the path the engine runs: the same READ ranges.

Real NIXL between processes (CPU DRAM): a pack consumer engine records every READ it posts; the
plan command's planner, over fake addresses, plans the same requests (same model, TP, cache
options and block ids). Per (request, source) the engine's READ must be the plan's read ranges
shifted by one base on each side (where the producer staged the request, where this rank's slice
is): same count, same lengths, same offsets.
"""

from __future__ import annotations

import numpy as np
import pytest
from harness import TINY, RankSpec
from pack_ops import hold_on_every_rank, start_engine, wait_results
from test_transfer import TOPOLOGIES, _layouts

from hybrid_transfer.cli.plan_cmd import plan_request
from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.layout import model_from_config
from hybrid_transfer.plan.scenario import fake_engine
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode

TOKENS = (37, 64, 100)
NUM_BLOCKS = 64


def record_reads(state, key) -> None:
    """Wrap the consumer's agent so every posted READ is kept (peer, local Nx3, remote Nx3)."""
    agent = state.ranks[key].engine.agent
    posted = state.extra[f"reads:{key}"] = []
    post = agent.post_read

    def recording(peer, local, remote, *args, **kwargs):
        posted.append((peer, np.array(local, dtype=np.int64), np.array(remote, dtype=np.int64)))
        return post(peer, local, remote, *args, **kwargs)

    agent.post_read = recording


def recorded_reads(state, key) -> list:
    return state.extra.pop(f"reads:{key}")


def _source_of(peer: str, engine_id: str) -> int:
    """Producer agents are named '{engine_id}-p{rank}-{incarnation}' (engine/producer.py)."""
    assert peer.startswith(f"{engine_id}-p"), peer
    return int(peer[len(engine_id) + 2:].split("-")[0])


@pytest.mark.parametrize("topology", ["1->2", "2->1", "2->4", "4->2"])
def test_plan_pack_and_the_engine_post_the_same_read_ranges(cluster, topology):
    p, d, p_opts, c_opts = TOPOLOGIES[topology]
    model = model_from_config(TINY, name="tiny")
    p_specs = [RankSpec(TINY, p, r, NUM_BLOCKS, p_opts) for r in range(p)]
    c_specs = [RankSpec(TINY, d, r, NUM_BLOCKS, c_opts) for r in range(d)]
    config = EngineConfig(mode=PlanMode.PACK, staging_bytes=1 << 20)
    producers = start_engine(cluster.workers[:p], p_specs, config, "cpu", True)
    consumers = start_engine(cluster.workers[p:p + d], c_specs, config, "cpu", False)
    try:
        rng = np.random.default_rng(11)
        remote = _layouts(p_specs[0].geometry(), list(TOKENS), NUM_BLOCKS, rng, extra=0)
        local = _layouts(c_specs[0].geometry(), list(TOKENS), NUM_BLOCKS, rng, extra=1)
        tickets = [hold_on_every_rank(producers, f"req-{i}", lay, 500 + i) for i, lay in enumerate(remote)]
        engine_reads = []
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("call", record_reads, k)
            for i, (ticket, lay) in enumerate(zip(tickets, local, strict=True)):  # one at a time: reads in order
                w.call("start_read", k, ticket, lay.block_ids, lay.num_tokens)
                (r,) = w.call("call", wait_results, k, [f"req-{i}"], 60.0)
                assert r.state == "done" and r.num_fallback_sources == 0, r
            engine_reads.append(w.call("call", recorded_reads, k))
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("check", k, [(lay, 500 + i) for i, lay in enumerate(local)])
    finally:
        producers.close()
        consumers.close()

    fake_p = fake_engine(model, p, p_opts, NUM_BLOCKS, engine_index=0)
    fake_d = fake_engine(model, d, c_opts, NUM_BLOCKS, engine_index=1)
    for rank in range(d):
        reads = iter(engine_reads[rank])
        for lay_r, lay_l in zip(remote, local, strict=True):
            plan = plan_request(model, fake_p, fake_d[rank], lay_l.block_ids, lay_r.block_ids, lay_r.num_tokens,
                                PlanMode.PACK)
            # One READ per source; requests were read one at a time, sources in whichever order they got ready.
            posted = [next(reads) for _ in plan.sources]
            by_source = {_source_of(peer, producers.engine_id): (loc, rem) for peer, loc, rem in posted}
            assert sorted(by_source) == sorted(s.source_rank for s in plan.sources)
            for src in plan.sources:
                assert isinstance(src, PackSourcePlan)
                got_local, got_remote = by_source[src.source_rank]
                read = src.read
                assert got_remote[:, 1].tolist() == read.length.tolist() == got_local[:, 1].tolist()
                remote_base = got_remote[:, 0] - read.remote_offset
                local_base = got_local[:, 0] - read.local_offset
                assert (remote_base == remote_base[0]).all() and (local_base == local_base[0]).all()
        assert next(reads, None) is None  # no READ the plan does not describe
