"""A spawned process hosting worker-side connectors (one per TP rank, each with its own NIXL agent).

Importing vLLM costs 10-20 s per process on these machines, so one host process carries every
rank of an engine. Each rank is built the way a vLLM worker builds it: the factory creates the
connector in the worker role, vLLM's ``allocate_kv_cache`` lays out the cache, and
``register_kv_caches`` gets vLLM's views. The worker's TP rank, which vLLM reads from its
distributed state, is patched per rank (no process group exists here).

Each engine step runs through vLLM's own model-runner code (``KVConnectorModelRunnerMixin``):
``_get_kv_connector_output`` binds the metadata, calls ``start_load_kv`` before or after the
"forward" as vLLM decides, then ``wait_for_save``, ``get_transfer_results``,
``get_block_ids_with_load_errors`` and the rest, and clears the metadata. The forward itself is
the test's: on prefill it writes the global-coordinate pattern into the request's blocks.

Nothing polls between commands: a rank's NIXL agent is progressed only by its engine's steps,
exactly as in vLLM. A READ from a prefill engine the test does not step stays in flight.
"""

from __future__ import annotations

import hashlib
import logging
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

IDLE_S = 0.05


@dataclass
class _Rank:
    connector: Any
    vllm_config: Any
    kv_cache_config: Any
    tp_rank: int


@dataclass
class _State:
    ranks: dict[str, _Rank] = field(default_factory=dict)


@contextmanager
def _as_rank(tp_rank: int, connector=None):
    """vLLM's per-process globals, pointed at one hosted rank for the duration of a call."""
    from unittest import mock

    from vllm.v1.worker import kv_connector_model_runner_mixin as mixin

    with mock.patch("hybrid_transfer.integrations.vllm.connector.tensor_parallel_rank", return_value=tp_rank):
        if connector is None:
            yield
        else:
            with mock.patch.object(mixin, "get_kv_transfer_group", return_value=connector):
                yield


def _cache(state: _State, key: str):
    return state.ranks[key].connector._worker.engine.cache


def op_create(state: _State, key: str, vllm_config, kv_cache_config, tp_rank: int, poison: bool):
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    from hybrid_transfer.verify import poison as poison_cache

    kernel_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
    with _as_rank(tp_rank):
        connector = KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        caches = allocate_kv_cache(kv_cache_config, _cpu(), KVCacheLayout.LBHNC, kernel_sizes)
        connector.register_kv_caches(caches)
    state.ranks[key] = _Rank(connector, vllm_config, kv_cache_config, tp_rank)
    if poison:
        poison_cache(connector._worker.engine.cache)
    return connector.get_handshake_metadata()


def _cpu():
    import torch

    return torch.device("cpu")


def op_step(state: _State, key: str, scheduler_output, fills):
    """One engine step of one rank, through vLLM's model-runner connector code; returns its KVConnectorOutput."""
    from vllm.forward_context import set_forward_context
    from vllm.v1.worker.kv_connector_model_runner_mixin import KVConnectorModelRunnerMixin

    from hybrid_transfer.verify import fill_source

    rank = state.ranks[key]
    with _as_rank(rank.tp_rank, rank.connector):
        with set_forward_context(None, rank.vllm_config), \
                KVConnectorModelRunnerMixin._get_kv_connector_output(scheduler_output) as output:
            for layout, seed in fills:  # the prefill forward: this step's writes
                fill_source(_cache(state, key), layout, seed)
    return output


def op_check(state: _State, key: str, layouts_and_seeds, zero_tails: bool):
    """Every byte of the rank's cache: pattern at valid coordinates, zero in each read's last-block tail, poison elsewhere."""
    from cache_oracle import check_after_load

    check_after_load(_cache(state, key), layouts_and_seeds, zero_tails)


def op_digest(state: _State, key: str, layout) -> str:
    """A hash of every byte of the request's blocks in every slot (to prove nothing writes them later)."""
    cache = _cache(state, key)
    h = hashlib.sha256()
    for tensor_index in range(cache.geometry.num_tensors):
        raw = cache.raw(tensor_index)
        for ids in layout.block_ids:
            for b in ids:
                h.update(raw[b].numpy().tobytes())
    return h.hexdigest()


def op_attention_is_zero(state: _State, key: str, layout) -> bool:
    """Whether every K and V byte of the request's attention blocks is zero (a failed load's blocks)."""
    from hybrid_transfer.layout.model import LayerKind

    cache = _cache(state, key)
    g = cache.geometry
    for group, ids in zip(g.tensor_map.groups, layout.block_ids, strict=True):
        if group.kind is not LayerKind.ATTENTION:
            continue
        for layer in group.layers:
            for view in (cache.k(layer), cache.v(layer)):
                for b in ids:
                    raw = view[b * g.kernel_ratio: (b + 1) * g.kernel_ratio].contiguous().view(torch_uint8())
                    if bool(raw.any()):
                        return False
    return True


def torch_uint8():
    import torch

    return torch.uint8


def op_reads(state: _State, key: str) -> dict[str, Any]:
    """The rank's consumer reads: request id -> (state, NIXL handle states)."""
    consumer = state.ranks[key].connector._worker._consumer
    if consumer is None:
        return {}
    out = {}
    for rid, req in consumer._requests.items():
        out[rid] = (req.state.value, [consumer.agent.check(h).value for h in req.handles])
    return out


def op_producer(state: _State, key: str) -> dict[str, Any]:
    producer = state.ranks[key].connector._worker.producer
    return {"num_held_requests": producer.num_held_requests, "num_held_blocks": producer.num_held_blocks}


def op_shutdown(state: _State, key: str) -> None:
    rank = state.ranks.pop(key, None)
    if rank is not None:
        rank.connector.shutdown()


def op_call(state: _State, key: str, func, *args):
    """Run a test's own function on a hosted rank (``func(state, key, *args)``)."""
    return func(state, key, *args)


_OPS = {name.removeprefix("op_"): fn for name, fn in globals().items() if name.startswith("op_")}


def host_main(conn, env: dict[str, str]) -> None:
    os.environ.update(env)
    logging.basicConfig(level=os.environ.get("HT_TEST_LOG", "WARNING"))
    import hybrid_transfer.integrations.vllm  # noqa: F401 - pay vLLM's import now, while the test sets up
    from hybrid_transfer.integrations.vllm_peer.pipe import serve

    state = _State()
    try:
        serve(conn, lambda op, args: _OPS[op](state, *args), IDLE_S)
    finally:
        for key in list(state.ranks):
            op_shutdown(state, key)


class HostError(Exception):
    """An exception raised inside a host process (its type, message and traceback)."""


class Host:
    """One spawned host process and its command pipe; ``send`` then ``recv`` lets several hosts work at once."""

    def __init__(self, ctx, name: str, env: dict[str, str] | None = None):
        import sys

        self.name = name
        self.conn, child = ctx.Pipe()
        env = {"PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}
        self.process = ctx.Process(target=host_main, args=(child, env), name=name, daemon=True)
        self.process.start()

    def send(self, op: str, *args) -> None:
        self.conn.send((op, args))

    def recv(self, timeout_s: float = 300.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"host {self.name} did not answer within {timeout_s} s")
        status, value = self.conn.recv()
        if status == "err":
            raise HostError(f"in {self.name}: {value}")
        return value

    def call(self, op: str, *args, timeout_s: float = 300.0):
        self.send(op, *args)
        return self.recv(timeout_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        from hybrid_transfer.integrations.vllm_peer import pipe

        pipe.close(self.process, self.conn)
