"""Hostile ``kv_transfer_params`` among honest requests, through vLLM's schedulers and real NIXL.

``kv_transfer_params`` is part of vLLM's request body: whatever a client or a broken proxy sends
reaches the connector. Each hostile request must end as vLLM's ``kv_load_failure_policy`` says
("fail": an error before any decode compute; "recompute": computed locally, counted) while the
honest requests of the same steps load and verify, and both engines end empty. Before the
connector judged params whole, ``addresses=["garbage"]`` raised an untyped ZMQError out of
``start_load_kv`` and failed the decode step for the whole batch.
"""

from __future__ import annotations

import copy

import pytest
from batch_queue import bad_bytes
from driver import Engine, run_until, seed_of
from flows import drain, prefill, ticket_params
from vllm.v1.engine import FinishReason
from vllm_engine import make_request

from hybrid_transfer.integrations.vllm import params as kvp

N = 100


def _hostile(honest_like: dict) -> dict[str, object]:
    """Each hostile variant of a forwarded params dict (a ticket naming a producer that is not there)."""

    def with_ticket(**fields) -> dict:
        params = copy.deepcopy(honest_like)
        params[kvp.TICKET].update(fields)
        return params

    internal = copy.deepcopy(honest_like)
    internal[kvp.TRUNCATED] = True
    return {
        # issue 19, table row 2
        "garbage-address": with_ticket(addresses=["garbage"]),
        "huge-tp": with_ticket(tp_size=2**100000),
        "2000-addresses": with_ticket(addresses=[f"tcp://127.0.0.1:{20000 + i}" for i in range(2000)], tp_size=2000),
        "huge-version": with_ticket(version=2**100000),
        # the plugin's own fields
        "internal-key": internal,
        "flag-not-bool": {**copy.deepcopy(honest_like), kvp.DO_REMOTE_PREFILL: "yes"},
        "not-an-object": ["garbage"],
    }


_ROW_2 = ("garbage-address", "huge-tp", "2000-addresses", "huge-version")


@pytest.mark.parametrize("fields", ["ticket", "plugin"])
@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_hostile_params_end_by_policy_while_honest_requests_verify(model_dir, hosts, policy, fields):
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True)
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False,
               kv_load_failure_policy=policy, num_blocks=128)
    try:
        honest = {f"h{i}": prefill(p, f"p-h{i}", N) for i in range(2)}
        hostile = {tag: params for tag, params in _hostile(ticket_params(N - 1)).items()
                   if (tag in _ROW_2) == (fields == "ticket")}
        requests = {}
        order = ["h0", *list(hostile)[:2], "h1", *list(hostile)[2:]]
        for tag in order:  # interleaved: hostile and honest requests share decode steps
            if tag in honest:
                requests[tag] = d.add(f"d-{tag}", N, params=honest[tag])
            else:
                # Set on the request itself: vLLM's SamplingParams refuses integers beyond 64 bits in
                # extra_args, but the connector must not rely on every path into the engine doing so.
                requests[tag] = make_request(f"d-{tag}", N)
                requests[tag].kv_transfer_params = hostile[tag]
                d.scheduler.add_request(requests[tag])
        finished, scheduled, received, bad = {}, {tag: 0 for tag in order}, set(), {}

        def note(engine, result):
            if engine is not d:
                return
            for tag in order:
                scheduled[tag] += result.scheduled.get(f"d-{tag}", 0)
            for tag in honest:
                if f"d-{tag}" in result.finished_recving and tag not in received:
                    received.add(tag)  # checked before any decode step writes its blocks
                    bad[tag] = d.call("call", bad_bytes, d.layout(f"d-{tag}", N - 1), seed_of(f"p-{tag}"))
            finished.update(result.finished)

        run_until("every decode request ends", lambda: len(finished) == len(order), [d, p], on_step=note)
        assert received == set(honest) and bad == {tag: 0 for tag in honest}
        for tag in honest:
            assert finished[f"d-{tag}"].finish_reason is FinishReason.LENGTH
            assert requests[tag].num_output_tokens == 2 and scheduled[tag] == 1 + 1  # token N, then one more
        counts = d.connector._scheduler.counts
        for tag in hostile:
            if policy == "fail":
                assert finished[f"d-{tag}"].finish_reason is FinishReason.ERROR, tag
                assert scheduled[tag] == 0, tag  # ended before any decode compute
            else:
                assert finished[f"d-{tag}"].finish_reason is FinishReason.LENGTH, tag
                assert scheduled[tag] >= N and requests[tag].num_output_tokens == 2, tag  # the whole prompt, here
        assert counts["loads_failed" if policy == "fail" else "loads_recomputed"] == len(hostile)
        drain((p, d))
        for engine in (p, d):  # the connector's per-request tables emptied with vLLM's
            left = engine.connector._scheduler.describe()
            assert not any(left[k] for k in ("loads", "truncated", "held", "reading", "reads", "fails")), left
    finally:
        p.shutdown()
        d.shutdown()


def test_a_client_setting_the_internal_truncation_flag_is_not_handed_off(model_dir, hosts):
    """``hybrid_transfer_truncated`` is the connector's own: a client sending it would skip the N-1 cut."""
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True)
    try:
        request = p.add("p-int", N, params={kvp.DO_REMOTE_DECODE: True, kvp.TRUNCATED: True})
        assert request.kv_transfer_params is None and request.num_prompt_tokens == N  # plain, not cut
        finished = {}
        run_until("the request ends", lambda: "p-int" in finished, [p],
                  on_step=lambda e, r: finished.update(r.finished))
        assert finished["p-int"].kv_transfer_params is None  # no ticket
        assert p.connector._scheduler.counts["params_refused"] == 1
        drain((p,))
    finally:
        p.shutdown()


def test_hand_offs_beyond_max_held_blocks_get_no_ticket(model_dir, hosts):
    """Clients asking for remote decode that nobody reads: beyond the cap, no ticket and the blocks free at once."""
    # 99 tokens at 16 per block: 7 attention blocks + 3 GDN state blocks = 10 pinned per hand-off.
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True,
               extra={"max_held_blocks": 15, "lease_s": 2.0})
    try:
        first = prefill(p, "p-1", N)
        assert first[kvp.TICKET]["num_tokens"] == N - 1
        free = p.num_free_blocks()
        second = {}
        p.add("p-2", N, params={kvp.DO_REMOTE_DECODE: True})
        run_until("the second prefill", lambda: "p-2" in second, [p], on_step=lambda e, r: second.update(r.finished))
        assert second["p-2"].kv_transfer_params is None
        assert p.num_free_blocks() == free  # its blocks went back to vLLM at once
        assert p.connector._scheduler.counts["hand_offs_refused"] == 1
        drain((p,), "the unread hold ends at its lease")
    finally:
        p.shutdown()


def _worker_orders(state, key):
    """Run in the decode rank's host: one step's orders with a ticket the scheduler would have refused and a read
    whose consumer call raises an untyped ZeroMQ error. Returns what the worker reports; raises if a hook raised."""
    from unittest import mock

    import msgspec
    import zmq

    from hybrid_transfer.engine.ticket_params import ticket_from_params
    from hybrid_transfer.integrations.vllm.metadata import HybridConnectorMetadata, ReadOrder

    worker = state.ranks[key].connector._worker
    good = ticket_from_params(ticket_params(N - 1)[kvp.TICKET])
    local = ((1, 2, 3, 4), (5,), (6,), (7,))
    reads = {"d-garbage": ReadOrder(msgspec.structs.replace(good, addresses=("garbage",)), local, N - 1),
             "d-untyped": ReadOrder(msgspec.structs.replace(good, request_id="p-untyped"), local, N - 1),
             "d-outside": ReadOrder(msgspec.structs.replace(good, request_id="p-outside"),
                                    ((1, 2, 3, 10**6), (5,), (6,), (7,)), N - 1)}
    real = worker.consumer._admit  # what start_reads runs for each order of the step

    def admit(ticket, *args, **kwargs):
        if ticket.request_id == "p-untyped":
            raise zmq.ZMQError(zmq.EINVAL, "injected")
        return real(ticket, *args, **kwargs)

    with mock.patch.object(worker.consumer, "_admit", admit):
        worker.start(HybridConnectorMetadata(reads=reads))
    _, recving, failed = worker.results()
    return recving, failed, worker.consumer.num_active


def test_the_worker_checks_each_order_again_and_no_hook_raises(model_dir, hosts):
    """Orders that reach a worker past the scheduler's check (a bug, a future path) fail their request only."""
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False)
    try:
        recving, failed, num_active = d.call("call", _worker_orders)
        assert recving == failed == {"d-garbage", "d-untyped", "d-outside"}
        assert num_active == 0  # nothing started: no socket, connect or pin for any of them
    finally:
        d.shutdown()
