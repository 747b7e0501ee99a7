"""One TP1 vLLM engine in this process: vLLM's Scheduler, one worker-side connector, caches from vLLM.

Built the way vLLM's engine core with an in-process executor builds them: the Scheduler creates
the scheduler-side connector from the config, the factory creates the worker side,
``allocate_kv_cache`` lays out the cache of the KVCacheConfig, ``register_kv_caches`` gets vLLM's
views, and the scheduler learns the worker's handshake metadata. A step is vLLM's own code:
``schedule``, the model runner's connector block (``_get_kv_connector_output``: bind metadata,
``start_load_kv``, ``wait_for_save``, ``get_transfer_results``...), ``update_from_output``. The
"forward" samples one token for every request whose prompt is computed and writes nothing.

Only the edges vLLM reads from a real worker process are given: TP rank 0 of 1 (no process
group), an attention backend for a model whose layers are never built, and no NUMA core list
(vLLM's NIXL worker on CPU would pin the whole process to one core; the connectors must see the
same cores). The hooks ``start_load_kv`` and ``get_transfer_results`` are timed on the worker's
thread (the same wrapper for both connectors), and so is every call into NIXL's agent made inside
them on that thread (both connectors use the same ``nixl_agent`` class), which splits a hook's
time into NIXL's and the connector's own.

Wave fence: a request's finished_sending / finished_recving id is handed to the scheduler only
once every request of its wave reported it (``fence``), so every run frees blocks in the same
order and the next wave gets the same block ids whatever the timing. Times are taken where the
connector reported, before the fence.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass, field
from unittest import mock

from hybrid_transfer.integrations.vllm_peer.model import EngineShape, build_configs

log = logging.getLogger(__name__)

TOKEN = 11  # what the "model" samples


class NoCorePinningPlatform:
    """vLLM's platform, except it reports no NUMA cores (vLLM's NIXL CPU worker pins the process to one)."""

    def __init__(self, real):
        self._real = real

    def discover_numa_topology(self):
        return []

    def __getattr__(self, name):
        return getattr(self._real, name)


@dataclass
class HookTimes:
    """Wall time on the worker's thread inside the two hooks, per step, and when each request was reported."""

    start_s: list[float] = field(default_factory=list)  # per step: inside start_load_kv
    results_s: list[float] = field(default_factory=list)  # per step: inside get_transfer_results
    nixl_s: float = 0.0  # running total: inside NIXL agent calls made from the hooks on the worker's thread
    descriptors: int = 0  # running total: local descriptors of the transfers created from the hooks
    in_hook: bool = False
    hook_thread: int = field(default_factory=threading.get_ident)
    step_start_t: list[float] = field(default_factory=list)  # per step: when start_load_kv was entered
    recv_t: dict[str, float] = field(default_factory=dict)  # request id -> first get_transfer_results naming it
    sent_t: dict[str, float] = field(default_factory=dict)
    failed: set[str] = field(default_factory=set)


# The agent calls of a transfer's life (descriptor lists, handles, posts, checks, notifications), either connector's.
NIXL_CALLS = ("prep_xfer_dlist", "make_prepped_xfer", "get_xfer_descs", "initialize_xfer", "transfer",
              "check_xfer_state", "release_xfer_handle", "release_dlist_handle", "send_notif", "get_new_notifs",
              "get_xfer_telemetry")


def _num_descriptors(name: str, args: tuple, kwargs: dict) -> int:
    """Local descriptors of a transfer being created: prepped indices or a descriptor list (0 for other calls)."""
    if name == "make_prepped_xfer":
        ids = args[2] if len(args) > 2 else kwargs.get("local_indices", ())
        return len(ids)
    if name == "initialize_xfer":
        descs = args[1] if len(args) > 1 else kwargs.get("local_descs")
        return descs.descCount() if descs is not None else 0
    return 0


def _timed_nixl(agent_cls, times: HookTimes, stack: contextlib.ExitStack) -> None:
    """Time NIXL's agent calls made inside a hook on the worker's thread (class-level, undone by ``stack``)."""
    for name in NIXL_CALLS:
        original = getattr(agent_cls, name, None)
        if original is None:
            continue

        def timed(self, *args, _original=original, **kwargs):
            if not times.in_hook or threading.get_ident() != times.hook_thread:
                return _original(self, *args, **kwargs)
            times.descriptors += _num_descriptors(_original.__name__, args, kwargs)
            t0 = time.perf_counter()
            try:
                return _original(self, *args, **kwargs)
            finally:
                times.nixl_s += time.perf_counter() - t0

        stack.enter_context(mock.patch.object(agent_cls, name, functools.wraps(original)(timed)))


def _timed_hooks(worker, times: HookTimes) -> None:
    """Wrap the worker connector's two per-step hooks (instance attributes shadow the class's methods)."""
    start_load_kv, get_transfer_results = worker.start_load_kv, worker.get_transfer_results

    def timed_start(forward_context, **kwargs):
        times.in_hook = True
        t0 = time.perf_counter()
        try:
            return start_load_kv(forward_context, **kwargs)
        finally:
            times.step_start_t.append(t0)
            times.start_s.append(time.perf_counter() - t0)
            times.in_hook = False

    def timed_results(finished_req_ids):
        times.in_hook = True
        t0 = time.perf_counter()
        try:
            out = get_transfer_results(finished_req_ids)
        finally:
            times.in_hook = False
        t1 = time.perf_counter()
        times.results_s.append(t1 - t0)
        for rid in out.finished_recving or ():
            times.recv_t.setdefault(rid, t1)
        for rid in out.finished_sending or ():
            times.sent_t.setdefault(rid, t1)
        times.failed |= set(out.failed_recving or ())
        return out

    worker.start_load_kv, worker.get_transfer_results = timed_start, timed_results


def fill_pattern(caches: dict, seed: int) -> None:
    """Fill every backing storage of ``caches`` with seeded random bytes (the same bytes for the same seed)."""
    import torch

    for i, storage in enumerate(_storages(caches)):
        flat = _flat(storage)
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)  # drawn on the CPU: the same bytes on any device
        flat.copy_(torch.randint(0, 256, (flat.numel(),), dtype=torch.uint8, generator=gen))
    _settle(caches)


POISON = 0x5A


def poison(caches: dict) -> None:
    """Write ``POISON`` over every byte of a decode cache: what no load wrote stays visibly wrong, and every page
    is resident before timing (``allocate_kv_cache``'s zeroed memory is mapped on first write; a serving
    engine's cache is long resident, and the first write's page faults would land in whichever hook touches a
    page first: measured 22 ms per request inside our tail zeroing on this host)."""
    for storage in _storages(caches):
        _flat(storage).fill_(POISON)
    _settle(caches)


def _settle(caches: dict) -> None:
    """On a GPU, wait for the writes queued on the caches: their bytes are in place before NIXL reads them."""
    import torch

    if any(s.device.type == "cuda" for s in _storages(caches)):
        torch.cuda.synchronize()


def _flat(storage):
    """A uint8 tensor over a whole untyped storage, on the storage's device."""
    import torch

    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


def _storages(caches: dict) -> list:
    seen, out = set(), []
    for view in caches.values():
        storage = view.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            out.append(storage)
    return out


def torch_device(device: str):
    """The torch device of an EngineShape's ``device``: the CPU, or GPU 0 (prefill and decode share one GPU)."""
    import torch

    return torch.device("cuda", 0) if device == "cuda" else torch.device(device)


def allocate(kvc, device: str = "cpu"):
    """vLLM's cache tensors for ``kvc`` on ``device`` (one backing allocation, LBHNC views, kernel block =
    logical block)."""
    from vllm.v1.kv_cache_interface import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    kernel_sizes = [g.kv_cache_spec.block_size for g in kvc.kv_cache_groups]
    return allocate_kv_cache(kvc, torch_device(device), KVCacheLayout.LBHNC, kernel_sizes)


class PeerEngine:
    """One engine (prefill or decode) of one connector kind: scheduler, worker connector, caches, a step loop."""

    def __init__(self, connector: str, kv_role: str, shape: EngineShape, *, seed: int):
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker
        from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

        from hybrid_transfer.integrations.vllm_peer.model import attention_backend

        self.connector_name, self.kv_role, self.shape = connector, kv_role, shape
        self.vllm_config, self.kv_cache_config = build_configs(connector, kv_role, shape)
        vc, kvc = self.vllm_config, self.kv_cache_config
        self._patches = contextlib.ExitStack()
        enter = self._patches.enter_context
        enter(mock.patch.object(base_worker, "get_tensor_model_parallel_rank", lambda: 0))
        enter(mock.patch.object(base_worker, "get_tensor_model_parallel_world_size", lambda: 1))
        enter(mock.patch("vllm.distributed.parallel_state.get_tensor_model_parallel_rank", lambda: 0))
        enter(mock.patch.object(base_worker, "get_current_attn_backends", lambda *a, **k: [attention_backend()]))
        enter(mock.patch.object(base_worker, "current_platform", NoCorePinningPlatform(base_worker.current_platform)))
        try:
            vc.cache_config.num_gpu_blocks = kvc.num_blocks
            scheduler_block, hash_block = resolve_kv_cache_block_sizes(kvc, vc)
            self.scheduler = vc.scheduler_config.get_scheduler_cls()(
                vllm_config=vc, kv_cache_config=kvc, log_stats=False,
                structured_output_manager=StructuredOutputManager(vc), block_size=scheduler_block,
                hash_block_size=hash_block)
            self.worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kvc)
            if shape.device == "cuda":
                import torch

                torch.cuda.set_device(torch_device(shape.device))  # this thread's context, as a GPU worker sets it
            self.caches = allocate(kvc, shape.device)
            if kv_role == "kv_producer":
                fill_pattern(self.caches, seed)
            else:
                poison(self.caches)
            self.worker.register_kv_caches(self.caches)
            enter(mock.patch.object(mixin, "get_kv_transfer_group", return_value=self.worker))
            # As EngineCore does once its workers registered their caches.
            self.scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): self.worker.get_handshake_metadata()})
        except BaseException:
            self._patches.close()
            raise
        self.times = HookTimes()
        _timed_hooks(self.worker, self.times)
        _timed_nixl(base_worker.NixlWrapper, self.times, self._patches)  # nixl's nixl_agent, which ours uses too
        self.aggregator = KVOutputAggregator.from_connector(self.scheduler.connector, 1)
        self._held_sending: set[str] = set()
        self._held_recving: set[str] = set()
        self.fence: set[str] = set()  # the current wave's request ids
        self.num_steps = 0

    # ---- requests -------------------------------------------------------------------
    def add(self, request_id: str, num_prompt_tokens: int, params: dict) -> None:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        sampling = SamplingParams(max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": params})
        tokens = [(7 * i + 3) % 200 + 1 for i in range(num_prompt_tokens)]
        self.scheduler.add_request(Request(request_id, tokens, sampling, None))

    def block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per vLLM group, clipped as a transfer uses them (vLLM's own selection)."""
        ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        return tuple(list(g) for g in self.kv_cache_config.select_transfer_block_ids(ids))

    def is_waiting_for_kvs(self, request_id: str) -> bool:
        from vllm.v1.request import RequestStatus

        request = self.scheduler.requests.get(request_id)
        return request is not None and request.status is RequestStatus.WAITING_FOR_REMOTE_KVS

    def is_idle(self) -> bool:
        """No request left and every block back in the pool (the null block aside)."""
        s = self.scheduler
        free = s.kv_cache_manager.block_pool.get_num_free_blocks()
        return not s.requests and not s.has_unfinished_requests() and free == self.kv_cache_config.num_blocks - 1

    # ---- one step -------------------------------------------------------------------
    def step(self) -> dict[str, object]:
        """One engine step; returns {request id: EngineCoreOutput} of the requests it finished."""
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

        out = self.scheduler.schedule()
        with set_forward_context(None, self.vllm_config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(out) as kv:
            pass
        self._fence(kv)
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in req_ids:
            request = self.scheduler.requests[rid]
            # schedule() already counted this step's tokens as computed
            sampled.append([TOKEN] if request.num_computed_tokens >= request.num_tokens else [])
        runner = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                   sampled_token_ids=sampled, kv_connector_output=kv)
        merged = self.aggregator.aggregate([runner])
        engine_outputs = self.scheduler.update_from_output(out, merged)
        self.num_steps += 1
        finished = {}
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finish_reason is not None:
                    finished[o.request_id] = o
        return finished

    def _fence(self, kv) -> None:
        """Hold a wave's completions until the whole wave reported (module docstring); release them at once."""
        for name, held in (("finished_sending", self._held_sending), ("finished_recving", self._held_recving)):
            reported = set(getattr(kv, name) or ())
            held |= reported & self.fence
            passed = reported - self.fence
            if self.fence and held >= self.fence:
                passed |= held
                held.clear()
            # Built in sorted order, so the scheduler walks (and frees) them in the same order in every run.
            setattr(kv, name, set(sorted(passed)) or None)

    def shutdown(self) -> None:
        try:
            self.worker.shutdown()
            self.scheduler.connector.shutdown()
        finally:
            self._patches.close()
