"""A producer killed mid-read, and a preempted prefill, through vLLM's schedulers and real NIXL."""

from __future__ import annotations

from driver import Engine, run_until, seed_of
from flows import drain, prefill, start_decode, ticket_params, until_received
from vllm.v1.request import RequestStatus

from hybrid_transfer.integrations.vllm import params as kvp

N = 100


def test_producer_killed_mid_read_is_a_failed_load_that_vllm_recomputes(model_dir, hosts):
    p = Engine("P", model_dir, [hosts["victim"]], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True)
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False,
               extra={"read_deadline_s": 20.0})
    try:
        params = prefill(p, "p-kill", N)
        request = start_decode(d, "d-kill", N, params)
        layout = d.layout("d-kill", N - 1)
        run_until("the READ is in flight", lambda: list(d.call("reads").values()) == [("reading", ["PROC"])], [p, d])
        hosts["victim"].kill()  # SIGKILL: the producer's memory and agent vanish mid-read
        failed, scheduled = [], []

        def note(engine, result):
            if "d-kill" in result.failed_recving:
                # Reported once nothing can write: the connector zeroed what the READ may have half filled.
                failed.append(d.call("attention_is_zero", layout))
            scheduled.append(result.scheduled.get("d-kill", 0))

        run_until("the load fails", lambda: bool(failed), [d], on_step=note)
        assert failed == [True]
        run_until("decode recomputes and finishes", d.is_empty, [d], on_step=note)
        # kv_load_failure_policy "recompute": vLLM drops the external tokens and runs the whole prompt.
        assert N in scheduled and request.num_output_tokens == 2
    finally:
        d.shutdown()


def test_prefill_preemption_truncates_once(model_dir, hosts):
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True,
               max_num_batched_tokens=32)  # chunked prefill: the request is preempted half-way
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False)
    try:
        request = p.add("p-pre", N, params={kvp.DO_REMOTE_DECODE: True})
        assert request.num_prompt_tokens == N - 1 and request.max_tokens == 1
        p.step()
        assert 0 < request.num_computed_tokens < N - 1
        assert p.scheduler.reset_prefix_cache(reset_running_requests=True)  # vLLM's own preemption path
        assert request.status is RequestStatus.PREEMPTED and request.num_preemptions == 1
        assert request.num_computed_tokens == 0
        p.connector.on_new_request(request)  # even seen again, the prompt is not cut twice
        assert request.num_prompt_tokens == N - 1 and len(request.prompt_token_ids) == N - 1
        params = prefill(p, "p-pre", N, add=False)
        assert params[kvp.TICKET]["num_tokens"] == N - 1
        start_decode(d, "d-pre", N, params)
        until_received(d, p, "d-pre")
        d.call("check", [(d.layout("d-pre", N - 1), seed_of("p-pre"))], True)
        drain((p, d))
    finally:
        p.shutdown()
        d.shutdown()


def test_an_unreachable_producer_is_a_failed_load_that_vllm_recomputes(model_dir, hosts):
    """The ticket names a side channel nobody answers: the handshake fails, the request is recomputed."""
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False,
               extra={"handshake_timeout_s": 1.0})
    try:
        request = start_decode(d, "d-lost", N, ticket_params(N - 1))
        failed, scheduled = [], []

        def note(engine, result):
            failed.extend(r for r in result.failed_recving if r == "d-lost")
            scheduled.append(result.scheduled.get("d-lost", 0))

        run_until("decode recomputes and finishes", d.is_empty, [d], on_step=note)
        assert failed == ["d-lost"] and N in scheduled and request.num_output_tokens == 2
    finally:
        d.shutdown()
