"""Steps of an engine whose GPU work lands late: EngineCore's batch queue, modelled on CPU.

On a GPU a step's writes (vLLM's zeroing of newly allocated blocks, the forward's KV and GDN
state writes) land on the compute stream at some moment before the engine processes that step's
output, while a NIXL READ lands whenever the network delivers it. This driver keeps each step's
writes pending on the rank (``hosted_step``) and applies them only when the step lands
(``land``), the latest moment the stream allows, so any READ that completes in between lands
first: the order that vLLM #48481 (zeroing after the READ) and #45357 (a finished request's
in-flight step writing blocks already freed and re-filled by a load) are about.

``launch`` schedules one step and runs it on every rank (worker hooks, the prefill fill), but the
scheduler does not see its output until ``land``. ``step_eagerly`` lands each step at once;
``BatchQueue.step`` schedules step N+1 before landing step N, as ``EngineCore.step_with_batch_queue``
does with two batches in flight under async scheduling.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from driver import Engine, StepResult
from vllm.v1.outputs import KVConnectorOutput

WRITE_BYTE = 0xEE  # what a late forward write leaves in a page (neither poison nor any pattern's whole page)


def configure_async(cfg) -> None:
    """Async scheduling on a built config, before the cache config and scheduler.

    The CPU platform turns async scheduling off in the config's post-init (vllm/platforms/cpu.py),
    so it is set after it. (The SSM cache dtype is named when the config is built: make_vllm_config.)
    """
    cfg.scheduler_config.async_scheduling = True


@dataclass
class Launched:
    """One scheduled step: the ranks ran it; its writes and its output are still in flight."""

    out: object
    runner_outputs: list
    step_id: int


@dataclass
class BatchQueue:
    """Two steps in flight, as EngineCore runs an engine with ``max_concurrent_batches == 2``."""

    engine: Engine
    size: int = 2
    queue: deque = field(default_factory=deque)

    def step(self) -> StepResult | None:
        """Schedule a step if the queue has room; land the oldest once the queue is full (or nothing else runs)."""
        s = self.engine.scheduler
        if s.has_requests() or not self.queue:
            launched = launch(self.engine)
            self.queue.append(launched)
            if len(self.queue) < self.size and (launched.out.total_num_scheduled_tokens > 0 or s.has_requests()):
                return StepResult()
        return land(self.engine, self.queue.popleft())

    def flush(self) -> list[StepResult]:
        return [land(self.engine, self.queue.popleft()) for _ in range(len(self.queue))]


def step_eagerly(engine: Engine) -> StepResult:
    return land(engine, launch(engine))


def launch(engine: Engine) -> Launched:
    out = engine.scheduler.schedule()
    fills = engine._fills(out) if engine.is_prefill else []
    writes = [] if engine.is_prefill else _forward_writes(engine, out)
    step_id = engine.num_steps
    engine.num_steps += 1
    for host, key in zip(engine.hosts, engine.keys, strict=True):
        host.send("call", key, hosted_step, out, fills, step_id, writes)
    kv_outputs: list[KVConnectorOutput] = [host.recv() for host in engine.hosts]
    # What the "model" samples is fixed when the step runs, not when it lands.
    return Launched(out, [engine._runner_output(out, kv) for kv in kv_outputs], step_id)


def land(engine: Engine, launched: Launched) -> StepResult:
    """The step's writes land on every rank, then the scheduler processes its output."""
    for rank in range(len(engine.hosts)):
        engine.call("call", apply_pending, launched.step_id, rank=rank)
    merged = engine.aggregator.aggregate(launched.runner_outputs)
    engine_outputs = engine.scheduler.update_from_output(launched.out, merged)
    return StepResult.of(launched.out, merged, engine_outputs)


def _forward_writes(engine: Engine, out) -> list[int]:
    """Blocks a decode step's forward writes: each scheduled request's GDN state blocks and the attention
    blocks of its new tokens (our block ids; a page is written whole)."""
    blocks: list[int] = []
    for rid, n in out.num_scheduled_tokens.items():
        request = engine.scheduler.requests[rid]
        end = request.num_computed_tokens
        start = end - n
        ours = engine.group_map.to_ours(engine.kv_cache_config.select_transfer_block_ids(
            engine.scheduler.kv_cache_manager.get_block_ids(rid)))
        for is_attention, ids in zip(engine.group_map.attention_mask, ours, strict=True):
            if is_attention:
                blocks.extend(ids[start // engine.block_size: -(-end // engine.block_size)])
            else:
                blocks.extend(ids[-1:])
    return blocks


# ---- run inside the rank host (rank_host.op_call) --------------------------------------

def _pending(state) -> dict:
    return state.__dict__.setdefault("pending_writes", {})


def hosted_step(state, key: str, out, fills, step_id: int, writes: list[int]):
    """rank_host.op_step with the step's GPU writes kept for ``apply_pending``: vLLM's zeroing of new blocks,
    the prefill forward's fills, the decode forward's page writes."""
    from rank_host import op_step

    zero = list(out.new_block_ids_to_zero or ())
    _pending(state)[(key, step_id)] = (zero, fills, writes)
    return op_step(state, key, out, [])


def apply_pending(state, key: str, step_id: int) -> None:
    """The step lands, in stream order: its zeroing, then its forward's writes."""
    from rank_host import _cache

    from hybrid_transfer.verify import fill_source

    zero, fills, writes = _pending(state).pop((key, step_id), ((), (), ()))
    cache = _cache(state, key)
    for index in range(cache.geometry.num_tensors):
        for b in zero:
            cache.raw(index)[b].fill_(0)
    for layout, seed in fills:
        fill_source(cache, layout, seed)
    for index in range(cache.geometry.num_tensors):
        for b in writes:
            cache.raw(index)[b].fill_(WRITE_BYTE)


def bad_bytes(state, key: str, layout, seed: int) -> int:
    """Bytes of the request's blocks where a correct load leaves data (pattern, zeroed attention tail) that differ.

    Bytes a load does not write (padding, the pages' unused parts) are left out: a reused block
    holds whatever its last user left there, and a load owes nothing to them. They are found as
    the bytes where two expected images, poisoned with bytes of one parity, disagree.
    """
    from cache_oracle import _zero_tail
    from rank_host import _cache

    from hybrid_transfer.cache import HybridCache
    from hybrid_transfer.verify import POISON_BYTE, expected_destination_many

    cache = _cache(state, key)
    images = []
    for poison_byte in (POISON_BYTE, POISON_BYTE ^ 0xFE):  # same bit 0: the same pattern
        image = HybridCache.wrap(cache.geometry, expected_destination_many(cache, [(layout, seed)], poison_byte))
        _zero_tail(image, layout)
        images.append(image)
    blocks = sorted({b for ids in layout.block_ids for b in ids})
    bad = 0
    for i in range(cache.geometry.num_tensors):
        want, other = images[0].raw(i)[blocks], images[1].raw(i)[blocks]
        bad += int(((cache.raw(i)[blocks] != want) & (want == other)).sum())
    return bad


def state_dtype(state, key: str) -> str:
    """The SSM state dtype of the rank's geometry (what the connector derived from vLLM's live spec)."""
    from rank_host import _cache

    return _cache(state, key).geometry.ssm_dtype.value
