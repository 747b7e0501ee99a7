"""vLLM 0.33's AsyncScheduler on both sides, with a bf16 SSM cache, through real NIXL between processes.

Production runs ``--async-scheduling``: two steps in flight, a step's output processed after the
next step was scheduled (``EngineCore.step_with_batch_queue``), and on a consumer vLLM defers
block frees behind in-flight steps (``defer_block_free``). The CPU platform switches async
scheduling off in the config's post-init, so each engine sets it back (batch_queue.configure_async);
the bf16 SSM cache is named when the config is built, and every test asserts what vLLM resolved.

Steps run eagerly or lazily through batch_queue.py, whose steps' GPU writes (zeroing of new
blocks, the forward's KV and state writes) land only when the step lands, after any READ that
completed meanwhile. The two races of the Qwen3.5 work are modelled with negative controls that
must make the byte check fail: zeroing after the READ (vLLM #48481; guarded by the connector's
``get_loaded_kv_cache_group_ids``) and a finished request's in-flight step writing blocks freed
and re-filled by a load (#45357; guarded by vLLM's deferred free).
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
from batch_queue import BatchQueue, bad_bytes, configure_async, land, launch, state_dtype, step_eagerly
from driver import Engine, seed_of
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.engine import FinishReason
from vllm.v1.kv_cache_interface import MambaSpec
from vllm.v1.request import RequestStatus

from hybrid_transfer.integrations.vllm import params as kvp

N = 100


def _engine(name, model_dir, host, *, prefill: bool, max_num_seqs: int = 8, **kwargs) -> Engine:
    def configure(cfg):
        configure_async(cfg)
        cfg.scheduler_config.max_num_seqs = max_num_seqs

    if prefill:
        return Engine(name, model_dir, [host], tp_size=1, block_size=16, kv_role="kv_producer", is_prefill=True,
                      configure=configure, ssm_dtype="bfloat16", **kwargs)
    return Engine(name, model_dir, [host], tp_size=1, block_size=32, kv_role="kv_consumer", is_prefill=False,
                  configure=configure, ssm_dtype="bfloat16", **kwargs)


def _assert_async(engine: Engine) -> None:
    """What vLLM resolved: AsyncScheduler, two batches in flight, deferred frees on the consumer, bf16 SSM state."""
    assert type(engine.scheduler) is AsyncScheduler
    assert engine.vllm_config.scheduler_config.async_scheduling and engine.vllm_config.max_concurrent_batches == 2
    assert engine.scheduler.defer_block_free is (not engine.is_prefill)  # vLLM defers on consumers only
    mamba = [g.kv_cache_spec for g in engine.kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert mamba and all(spec.dtypes[1] == torch.bfloat16 for spec in mamba)
    assert engine.call("call", state_dtype) == "bfloat16"  # the connector's geometry followed the live spec


@contextlib.contextmanager
def _async_pair(model_dir, hosts, prefill: dict | None = None, decode: dict | None = None):
    """(prefill, decode) engines on AsyncScheduler, what vLLM resolved asserted on both; both shut down after."""
    p = _engine("P", model_dir, hosts["prefill"], prefill=True, **(prefill or {}))
    try:
        d = _engine("D", model_dir, hosts["decode"], prefill=False, **(decode or {}))
    except BaseException:
        p.shutdown()
        raise
    try:
        _assert_async(p)
        _assert_async(d)
        yield p, d
    finally:
        p.shutdown()
        d.shutdown()


class _Run:
    """Steps prefill and decode engines, eagerly or through a batch queue; checks each load as it is reported."""

    def __init__(self, p: Engine, d: Engine, *, lazy: bool):
        self.p, self.d = p, d
        self.queues = {e.name: BatchQueue(e) for e in (p, d)} if lazy else {}
        self.finished: dict[str, object] = {}
        self.handed_off: dict[str, dict] = {}
        self.loaded: dict[str, int] = {}  # decode request -> bad bytes when its load was reported
        self.scheduled_prefills: list[int] = []  # prompts per prefill step

    def round(self) -> None:
        for engine in (self.p, self.d):
            queue = self.queues.get(engine.name)
            self.observe(engine, queue.step() if queue is not None else step_eagerly(engine))

    def observe(self, engine: Engine, result) -> None:
        if engine is self.p:
            self.scheduled_prefills.append(sum(1 for n in result.scheduled.values() if n > 1))
            for rid, out in result.finished.items():
                if out.kv_transfer_params is not None:
                    self.handed_off[rid] = out.kv_transfer_params
            return
        self.finished.update(result.finished)
        for rid in result.finished_recving - result.failed_recving:
            if rid in self.d.scheduler.requests:  # checked before any decode step of it lands
                seed = seed_of("p-" + rid.removeprefix("d-"))
                self.loaded[rid] = self.d.call("call", bad_bytes, self.d.layout(rid, N - 1), seed)

    def until(self, what: str, done, max_rounds: int = 3000) -> None:
        for _ in range(max_rounds):
            if done():
                return
            self.round()
        raise AssertionError(f"{what}: not reached after {max_rounds} rounds")

    def drained(self) -> bool:
        return all(not q.queue for q in self.queues.values()) and self.p.is_empty() and self.d.is_empty()


def _prefill_all(run: _Run, tags) -> None:
    for tag in tags:
        request = run.p.add(f"p-{tag}", N, params={kvp.DO_REMOTE_DECODE: True})
        assert request.num_prompt_tokens == N - 1 and request.max_tokens == 1  # the N-1 rule on prefill
    run.until("every prefill hands off", lambda: all(f"p-{t}" in run.handed_off for t in tags))


def _decode_all(run: _Run, tags) -> None:
    requests = {}
    for tag in tags:
        params = run.handed_off[f"p-{tag}"]
        assert params[kvp.TICKET]["num_tokens"] == params[kvp.TICKET]["state_position"] == N - 1
        requests[tag] = run.d.add(f"d-{tag}", N, params=params)
    run.until("every decode finishes", lambda: all(f"d-{t}" in run.finished for t in tags))
    for tag, request in requests.items():
        assert run.loaded.get(f"d-{tag}") == 0, tag  # every byte of every group, when its load was reported
        assert request.num_output_tokens == 2 and run.finished[f"d-{tag}"].finish_reason is FinishReason.LENGTH


def _served(p: Engine, d: Engine) -> None:
    """Step only the prefill engine until every READ decode has posted is complete (decode lands nothing)."""
    for _ in range(200):
        if all(s == "DONE" for _, handles in d.call("reads").values() for s in handles):
            return
        step_eagerly(p)
    raise AssertionError(f"the READs did not complete: {d.call('reads')}")


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
def test_async_scheduling_both_sides_n_minus_1_and_64_concurrent_requests(model_dir, hosts, lazy):
    """64 requests (lazy) with several prompts per prefill step, or 8 (eager); N-1 on both sides; bytes verified."""
    count = 64 if lazy else 8
    # 99 tokens at 16 per block: 7 attention + 3 state blocks held per hand-off until decode reads them.
    with _async_pair(model_dir, hosts,
                     prefill={"max_num_seqs": count, "num_blocks": count * 10 + 16, "max_num_batched_tokens": 1024,
                              "extra": {"max_held_blocks": count * 10}},
                     decode={"max_num_seqs": count, "num_blocks": count * 7 + 16}) as (p, d):
        run = _Run(p, d, lazy=lazy)
        tags = [f"{'l' if lazy else 'e'}{i}" for i in range(count)]
        _prefill_all(run, tags)
        assert max(run.scheduled_prefills) >= 2  # several prompts per prefill step
        _decode_all(run, tags)
        run.until("both engines empty", run.drained)


@pytest.mark.parametrize("guarded", [True, False], ids=["connector-groups", "switched-off"])
def test_zeroing_landing_after_the_read(model_dir, hosts, guarded):
    """vLLM #48481: the new blocks a load fills must not be zeroed by a step that lands after the READ.

    The request's first decode step allocates its blocks, the worker posts the READ, the prefill
    engine serves it, and only then does that step's zeroing land. The connector names every
    transfer group in ``get_loaded_kv_cache_group_ids``, so vLLM zeroes none of them; switched off
    (no group named), vLLM zeroes the attention blocks and the check must fail.
    """
    with _async_pair(model_dir, hosts) as (p, d):
        run = _Run(p, d, lazy=False)
        _prefill_all(run, ["warm", "race"])
        _decode_all(run, ["warm"])  # links the consumer to the producer: the race's READ posts at once
        # Switched off: the connector names no loaded group (here vLLM's default, the prefix-cacheable groups,
        # happens to be every group, so it would not show the race).
        switched_off = mock.patch.object(d.connector, "get_loaded_kv_cache_group_ids", lambda request: ())
        with contextlib.nullcontext() if guarded else switched_off:
            d.add("d-race", N, params=run.handed_off["p-race"])
            step = launch(d)  # allocates, orders and posts the READ; its zeroing is still in flight
        assert d.status("d-race") is RequestStatus.WAITING_FOR_REMOTE_KVS
        layout = d.layout("d-race", N - 1)
        zeroed = set(step.out.new_block_ids_to_zero or ())
        loaded = {b for ids in layout.block_ids for b in ids}
        assert bool(zeroed & loaded) is not guarded  # what vLLM was told to zero
        reads = d.call("reads")
        assert [h for _, h in reads.values()] and all(h for _, h in reads.values()), reads  # posted
        _served(p, d)  # the prefill engine serves the READ; decode has not landed its step
        run.observe(d, land(d, step))  # the zeroing lands after the READ
        run.until("the race request finishes", lambda: "d-race" in run.finished)
        if guarded:
            assert run.loaded["d-race"] == 0
        else:
            assert run.loaded["d-race"] > 0  # the check bites: the model of the race is real
        run.until("both engines empty", run.drained)


@pytest.mark.parametrize("deferred", [True, False], ids=["deferred-free", "switched-off"])
def test_a_finished_requests_in_flight_step_does_not_write_a_loaded_request(model_dir, hosts, deferred):
    """vLLM #45357: a request aborted while its decode step is in flight; a load reuses its blocks.

    The decode pool holds one request: R decodes; S waits for blocks. R is aborted while step N
    (which writes R's state and KV) is in flight. With vLLM's deferred free, R's blocks stay out
    of the pool until step N lands, so S's READ lands after N's writes. Without it S gets R's
    blocks at once, its READ lands, then N's writes land on S's bytes: the check must fail.
    """
    # 100 + 8 tokens at 32 per block: 4 attention blocks + 3 GDN state blocks; one request fits (+ the null block).
    with _async_pair(model_dir, hosts, decode={"num_blocks": 8}) as (p, d):
        if not deferred:
            d.scheduler.defer_block_free = False
        run = _Run(p, d, lazy=False)
        _prefill_all(run, ["warm", "r", "s"])
        _decode_all(run, ["warm"])
        r = d.add("d-r", N, params=run.handed_off["p-r"], max_tokens=8)
        run.until("R decodes", lambda: r.num_output_tokens >= 1)
        d.add("d-s", N, params=run.handed_off["p-s"])
        r_blocks = {b for ids in d.scheduler.kv_cache_manager.get_block_ids("d-r") for b in ids}
        step = launch(d)  # R's decode step: its writes are in flight
        assert "d-r" in step.out.num_scheduled_tokens and "d-s" not in step.out.num_scheduled_tokens
        d.abort("d-r")  # the client goes away while step N runs
        second = launch(d)  # S is scheduled only if R's blocks are back in the pool
        s_scheduled = d.status("d-s") is RequestStatus.WAITING_FOR_REMOTE_KVS
        assert s_scheduled is not deferred
        if s_scheduled:
            assert {b for ids in d.layout("d-s", N - 1).block_ids for b in ids} <= r_blocks
            _served(p, d)  # S's READ lands before step N's writes do
        run.observe(d, land(d, step))
        run.observe(d, land(d, second))
        run.until("S finishes", lambda: "d-s" in run.finished)
        assert r.status is RequestStatus.FINISHED_ABORTED
        if deferred:
            assert run.loaded["d-s"] == 0
        else:
            assert run.loaded["d-s"] > 0  # the check bites: the model of the race is real
        run.until("both engines empty", run.drained)


def test_decode_aborts_while_a_step_is_in_flight(model_dir, hosts):
    """40 of 48 decode requests aborted between a step's launch and its landing, in every state a load passes
    through (waiting for blocks, waiting for its READ, running); the other 8 verify and both engines end empty."""
    count, num_aborts = 48, 40
    with _async_pair(model_dir, hosts,
                     prefill={"max_num_seqs": count, "num_blocks": count * 10 + 16, "max_num_batched_tokens": 1024,
                              "extra": {"max_held_blocks": count * 10}},
                     decode={"max_num_seqs": 16, "num_blocks": 16 * 7 + 8}) as (p, d):
        run = _Run(p, d, lazy=True)
        tags = [f"a{i}" for i in range(count)]
        _prefill_all(run, tags)
        requests = {t: d.add(f"d-{t}", N, params=run.handed_off[f"p-{t}"]) for t in tags}
        aborted: dict[str, RequestStatus] = {}
        kept = set(tags[::6])  # 8 requests run to the end

        def abort_some() -> bool:
            assert run.queues["D"].queue, "a decode step is in flight"
            for tag in tags:
                if len(aborted) >= num_aborts or len(aborted) > 2 * run.p.num_steps:
                    break  # spread over the rounds
                status = d.status(f"d-{tag}")
                if tag in kept or tag in aborted or status is None:
                    continue
                d.abort(f"d-{tag}")
                aborted[tag] = status
            return all(f"d-{t}" in run.finished for t in kept) and len(aborted) == num_aborts

        run.round()
        run.until("every abort and every kept request done", abort_some)
        assert {RequestStatus.WAITING, RequestStatus.WAITING_FOR_REMOTE_KVS, RequestStatus.RUNNING} <= set(
            aborted.values()), aborted
        for tag in kept:
            assert run.loaded.get(f"d-{tag}") == 0 and requests[tag].num_output_tokens == 2, tag
        assert all(requests[t].status is RequestStatus.FINISHED_ABORTED for t in aborted)
        run.until("both engines empty", run.drained)
        assert p.call("producer")["num_held_requests"] == 0  # every aborted read freed its hold


def test_prefill_aborts_across_chunk_offsets_while_a_step_is_in_flight(model_dir, hosts):
    """12 prefills aborted at chunk offsets 0-3 (32-token chunks) between a step's launch and landing: none hands
    off or holds anything; two honest ones among them hand off and verify."""
    with _async_pair(model_dir, hosts, prefill={"max_num_batched_tokens": 32}) as (p, d):
        run = _Run(p, d, lazy=True)
        targets = {f"c{i}": (i % 4) * 32 for i in range(12)}  # abort once this many prompt tokens were scheduled
        honest = ["h0", "h1"]
        for tag in [*targets, *honest]:
            p.add(f"p-{tag}", N, params={kvp.DO_REMOTE_DECODE: True})
        offsets: dict[str, int] = {}

        def abort_at_offsets() -> bool:
            for tag, target in targets.items():
                request = p.scheduler.requests.get(f"p-{tag}")
                if tag not in offsets and request is not None and request.num_computed_tokens >= target:
                    assert run.queues["P"].queue, "a prefill step is in flight"
                    offsets[tag] = request.num_computed_tokens
                    p.abort(f"p-{tag}")
            return len(offsets) == len(targets) and all(f"p-{t}" in run.handed_off for t in honest)

        run.round()
        run.until("every abort and the honest hand-offs", abort_at_offsets)
        assert {o // 32 for o in offsets.values()} == {0, 1, 2, 3}  # every chunk offset was hit
        assert not any(f"p-{t}" in run.handed_off for t in targets)
        _decode_all(run, honest)
        run.until("both engines empty", run.drained)
        assert p.call("producer") == {"num_held_requests": 0, "num_held_blocks": 0}
