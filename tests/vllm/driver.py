"""Drives a vLLM engine the way EngineCore does: schedule, run every worker, aggregate, update.

The scheduler is vLLM's own (in this process); the workers are HybridNixlConnector instances
in host processes; worker outputs are merged by vLLM's own ``KVOutputAggregator``; the model
runner's output is ours (this file writes what a model would sample: one token per request
whose known tokens are all computed).
"""

from __future__ import annotations

import json
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from rank_host import Host
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import RequestStatus
from vllm_engine import make_kv_cache_config, make_request, make_scheduler, make_vllm_config, request_block_hasher

from hybrid_transfer.verify import RequestLayout

TOKEN = 11  # what the "model" samples (the requests ignore EOS)


def seed_of(prefill_request_id: str) -> int:
    """The pattern seed of a request: a function of the id the ticket names, known to both sides."""
    return zlib.crc32(prefill_request_id.encode())


def through_json(params: dict) -> dict:
    """What a proxy forwards: the dict, serialized and parsed (it must survive JSON unchanged)."""
    forwarded = json.loads(json.dumps(params))
    assert forwarded == params, "kv_transfer_params do not survive JSON"
    return forwarded


@dataclass
class StepResult:
    finished: dict[str, object] = field(default_factory=dict)  # request id -> EngineCoreOutput that finished it
    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens scheduled this step

    @classmethod
    def of(cls, out, merged, engine_outputs) -> StepResult:
        """What a step did: the scheduler's output ``out``, the merged runner output and update_from_output's."""
        result = cls(scheduled=dict(out.num_scheduled_tokens))
        kv = merged.kv_connector_output
        if kv is not None:
            result.finished_sending = set(kv.finished_sending or ())
            result.finished_recving = set(kv.finished_recving or ())
            result.failed_recving = set(kv.failed_recving or ())
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    result.finished[o.request_id] = o
        return result


class Engine:
    """One vLLM engine: its real Scheduler here, one worker-side connector per TP rank on ``hosts``."""

    def __init__(self, name: str, model_dir, hosts: Sequence[Host], *, tp_size: int, block_size: int, kv_role: str,
                 num_blocks: int = 64, extra: dict | None = None, is_prefill: bool, poison: bool = True,
                 configure: Callable | None = None, **cfg_kwargs):
        """``configure(vllm_config)`` runs after the config's post-init, before the cache config and scheduler
        are built (what the CPU platform resets there, e.g. async scheduling, a test sets back)."""
        self.name = name
        self.is_prefill = is_prefill
        self.vllm_config = make_vllm_config(model_dir, tp_size=tp_size, block_size=block_size, kv_role=kv_role,
                                            extra=extra, **cfg_kwargs)
        if configure is not None:
            configure(self.vllm_config)
        self.kv_cache_config = make_kv_cache_config(self.vllm_config, num_blocks)
        self.scheduler = make_scheduler(self.vllm_config, self.kv_cache_config)
        self.block_hasher = (request_block_hasher(self.vllm_config, self.kv_cache_config)
                             if self.vllm_config.cache_config.enable_prefix_caching else None)
        self.connector = self.scheduler.connector
        self.hosts = [hosts[r % len(hosts)] for r in range(tp_size)]
        self.keys = [f"{name}-{self.vllm_config.kv_transfer_config.engine_id}-r{r}" for r in range(tp_size)]
        for r, (host, key) in enumerate(zip(self.hosts, self.keys, strict=True)):
            host.send("create", key, self.vllm_config, self.kv_cache_config, r, poison)
        cards = {(0, r): host.recv() for r, host in enumerate(self.hosts)}
        # As EngineCore does once the workers registered their caches.
        self.connector.set_xfer_handshake_metadata_pp_aware(cards)
        self.aggregator = KVOutputAggregator.from_connector(self.connector, tp_size)
        self.group_map = self.connector._scheduler.group_map
        self.block_size = block_size
        self.seeds: dict[str, int] = {}  # prefill request id -> pattern seed
        self.num_steps = 0

    # ---- requests -------------------------------------------------------------------
    def add(self, request_id: str, num_tokens: int, *, params: dict, max_tokens: int = 2):
        request = make_request(request_id, num_tokens, max_tokens=max_tokens, params=params,
                               block_hasher=self.block_hasher)
        self.scheduler.add_request(request)
        if self.is_prefill:
            self.seeds[request_id] = seed_of(request_id)
        return request

    def layout(self, request_id: str, num_tokens: int) -> RequestLayout:
        """A request's blocks in our group order, clipped as a transfer uses them (the test's own arithmetic)."""
        vllm_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        ours = self.group_map.to_ours(self.kv_cache_config.select_transfer_block_ids(vllm_ids))
        clipped = []
        for is_attention, ids in zip(self.group_map.attention_mask, ours, strict=True):
            clipped.append(tuple(ids[: -(-num_tokens // self.block_size)]) if is_attention else tuple(ids[-1:]))
        return RequestLayout(tuple(clipped), num_tokens)

    # ---- one step -------------------------------------------------------------------
    def step(self) -> StepResult:
        out = self.scheduler.schedule()
        fills = self._fills(out) if self.is_prefill else []
        for host, key in zip(self.hosts, self.keys, strict=True):
            host.send("step", key, out, fills)
        kv_outputs: list[KVConnectorOutput] = [host.recv() for host in self.hosts]
        runner_outputs = [self._runner_output(out, kv) for kv in kv_outputs]
        merged = self.aggregator.aggregate(runner_outputs)
        engine_outputs = self.scheduler.update_from_output(out, merged)
        self.num_steps += 1
        return StepResult.of(out, merged, engine_outputs)

    def _fills(self, out) -> list[tuple[RequestLayout, int]]:
        """The prefill forward's writes: every scheduled request's blocks, up to its computed tokens."""
        fills = []
        for rid in out.num_scheduled_tokens:
            request = self.scheduler.requests[rid]
            fills.append((self.layout(rid, request.num_computed_tokens), self.seeds[rid]))
        return fills

    def _runner_output(self, out, kv: KVConnectorOutput) -> ModelRunnerOutput:
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            sampled.append([TOKEN] if request.num_computed_tokens >= request.num_tokens else [])
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled, kv_connector_output=kv)

    def abort(self, request_id: str) -> None:
        """What the API server does when a client goes away."""
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    # ---- state ----------------------------------------------------------------------
    def status(self, request_id: str) -> RequestStatus | None:
        request = self.scheduler.requests.get(request_id)
        return request.status if request is not None else None

    def is_empty(self) -> bool:
        """No request left and every block back in the pool (the null block aside)."""
        s = self.scheduler
        pool = s.kv_cache_manager.block_pool
        return (not s.requests and not s.running and len(s.waiting) == 0 and not s.has_unfinished_requests()
                and pool.get_num_free_blocks() == self.kv_cache_config.num_blocks - 1)

    def num_free_blocks(self) -> int:
        return self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()

    def call(self, op: str, *args, rank: int = 0):
        return self.hosts[rank].call(op, self.keys[rank], *args)

    def shutdown(self) -> None:
        for host, key in zip(self.hosts, self.keys, strict=True):
            try:
                host.call("shutdown", key)
            except Exception:  # noqa: BLE001 - a killed host has nothing to shut down
                pass


def run_until(what: str, done: Callable[[], bool], engines: Sequence[Engine], *, max_steps: int = 2000,
              on_step: Callable[[Engine, StepResult], None] | None = None) -> None:
    """Step ``engines`` in turn until ``done()``; fail naming ``what`` after ``max_steps`` rounds."""
    for _ in range(max_steps):
        if done():
            return
        for engine in engines:
            result = engine.step()
            if on_step is not None:
                on_step(engine, result)
        time.sleep(0.001)
    if not done():
        raise AssertionError(f"{what}: not reached after {max_steps} rounds")
