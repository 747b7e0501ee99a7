"""Prefill -> ticket -> decode through vLLM's real schedulers, worker connectors over real NIXL
between processes, every group's bytes checked against the global-coordinate oracle.

Block sizes are configured explicitly and differ on the two sides (the tiny model's default
geometry makes them equal), so the planner maps token ranges between pages of different sizes.
"""

from __future__ import annotations

import pytest
from driver import Engine, run_until, seed_of, through_json
from flows import drain, prefill, start_decode, until_received, waiting_for_kvs

from hybrid_transfer.integrations.vllm import params as kvp

N = 100  # prompt tokens: N-1 = 99 move, a partial last block on both sides


def _engines(model_dir, hosts, *, p_tp: int, d_tp: int, p_block: int = 16, d_block: int = 32):
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=p_tp, block_size=p_block, kv_role="kv_producer",
               is_prefill=True)
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=d_tp, block_size=d_block, kv_role="kv_consumer",
               is_prefill=False)
    return p, d


def _lifecycle(p: Engine, d: Engine, tag: str) -> None:
    total_p = p.num_free_blocks()
    params = prefill(p, f"p-{tag}", N)
    ticket = params[kvp.TICKET]
    assert params[kvp.DO_REMOTE_PREFILL] is True and params["remote_num_tokens"] == N - 1
    assert ticket["num_tokens"] == N - 1 == ticket["state_position"]
    assert p.scheduler.requests[f"p-{tag}"].num_prompt_tokens == N - 1  # cut once, at on_new_request
    assert p.num_free_blocks() < total_p  # the finished request's blocks stay pinned for decode

    request = start_decode(d, f"d-{tag}", N, params)
    assert waiting_for_kvs(d, f"d-{tag}") and request.num_computed_tokens == N - 1
    until_received(d, p, f"d-{tag}")
    layout = d.layout(f"d-{tag}", N - 1)
    for rank in range(len(d.keys)):
        d.call("check", [(layout, seed_of(f"p-{tag}"))], True, rank=rank)
    drain((p, d))
    assert request.num_output_tokens == 2 and request.num_computed_tokens >= N  # ran after the load


def test_lifecycle_tp1_with_different_block_sizes(model_dir, hosts):
    p, d = _engines(model_dir, hosts, p_tp=1, d_tp=1)
    try:
        _lifecycle(p, d, "tp1")
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 1), (1, 2)], ids=["P2-D1", "P1-D2"])
def test_hetero_tp_with_different_block_sizes(model_dir, hosts, p_tp, d_tp):
    p, d = _engines(model_dir, hosts, p_tp=p_tp, d_tp=d_tp)
    try:
        _lifecycle(p, d, f"p{p_tp}d{d_tp}")
    finally:
        p.shutdown()
        d.shutdown()


def _consumer_counts(state, key) -> tuple[int, int, int]:
    """Run in the decode rank's host: its consumer's READs posted, claim entries sent, requests reported DONE."""
    stats = state.ranks[key].connector._worker._consumer.stats
    return stats.reads_posted, stats.claims_sent, stats.done


def test_concurrent_requests_short_and_full_block_prompts(model_dir, hosts):
    """Three requests in flight at once: a prompt shorter than a block, one whose N-1 tokens fill whole
    blocks on both sides (no tail), and one with partial last blocks. Their loads start in one step, so
    start_load_kv's one start_reads call posts one READ for all three (read_batching "per_step")."""
    p, d = _engines(model_dir, hosts, p_tp=1, d_tp=1)
    lengths = {"short": 10, "full": 97, "partial": 100}
    try:
        for tag, n in lengths.items():
            p.add(f"p-{tag}", n, params={kvp.DO_REMOTE_DECODE: True})
        finished = {}
        run_until("every prefill", lambda: len(finished) == len(lengths), [p],
                  on_step=lambda e, r: finished.update(r.finished))
        for tag, n in lengths.items():
            d.add(f"d-{tag}", n, params=through_json(finished[f"p-{tag}"].kv_transfer_params))
        received: set[str] = set()
        run_until("every load", lambda: len(received) == len(lengths), [d, p],
                  on_step=lambda e, r: received.update(r.finished_recving) if e is d else None)
        layouts = [(d.layout(f"d-{tag}", n - 1), seed_of(f"p-{tag}")) for tag, n in lengths.items()]
        d.call("check", layouts, True)
        assert d.call("call", _consumer_counts) == (1, 3, 3)  # one READ, three claims: one step, one agent
        drain((p, d))
    finally:
        p.shutdown()
        d.shutdown()
