"""HybridNixlConnector: the class vLLM loads from ``kv_connector_module_path``.

A thin facade: vLLM builds one instance per role (scheduler: in the engine core; worker: one per
TP rank) and this class forwards each hook to the half that owns it (scheduler.py, worker.py).
Settings come from ``kv_connector_extra_config`` (EngineConfig fields): one dict for every rank of
every data-parallel engine of an endpoint, resolved per rank by ``rank_config`` (docs/dep.md).
"""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from hybrid_transfer.engine.auth import load_secret
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.engine.tickets import EngineCard, decode_rank_card
from hybrid_transfer.errors import UnsupportedError
from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.integrations.vllm.geometry import REQUIRED_LAYOUT, model_of, wrap_engine_cache
from hybrid_transfer.integrations.vllm.groups import GroupMap, draft_layers_of
from hybrid_transfer.integrations.vllm.metadata import HandshakeCard, HybridConnectorMetadata
from hybrid_transfer.integrations.vllm.scheduler import SchedulerSide
from hybrid_transfer.integrations.vllm.stats import HybridKVConnectorStats, HybridPromMetrics
from hybrid_transfer.integrations.vllm.worker import WorkerSide
from hybrid_transfer.layout.tensor_map import build_tensor_map

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


def tensor_parallel_rank() -> int:
    """This worker's TP rank (vLLM's parallel state; tests that host several ranks in one process patch it)."""
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank()


def rank_config(vllm_config: VllmConfig, extra: dict[str, Any], tp_rank: int) -> EngineConfig:
    """The engine settings of TP rank ``tp_rank`` of this DP engine: port base + dp_index x tp_size + tp_rank.

    The DP index is vLLM's ``data_parallel_index`` (set per engine core), not ``data_parallel_rank``,
    which vLLM resets to 0 on every independent (dense) DP engine.
    """
    parallel = vllm_config.parallel_config
    return EngineConfig.from_dict(extra, tp_rank=tp_rank, tp_size=parallel.tensor_parallel_size,
                                  dp_index=parallel.data_parallel_index)


def incarnation_of(vllm_config: VllmConfig) -> int:
    """One value for every process of one engine launch, a new one at each launch (JSON-safe: < 2**48).

    The scheduler and every worker derive it alike from the engine id and vLLM's per-launch
    instance id, so no process has to tell another.
    """
    key = f"{vllm_config.kv_transfer_config.engine_id}/{vllm_config.instance_id}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:6], "big")


class HybridNixlConnector(KVConnectorBase_V1, SupportsHMA):
    """Moves a hybrid model's cache (attention KV + GDN state) from prefill to decode engines over NIXL."""

    _cache_hit_source = CacheHitSource.P2P

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig):
        super().__init__(vllm_config, role, kv_cache_config)
        kvt = vllm_config.kv_transfer_config
        if vllm_config.parallel_config.pipeline_parallel_size > 1:
            raise UnsupportedError("HybridNixlConnector does not support pipeline parallelism "
                                   f"(pipeline_parallel_size={vllm_config.parallel_config.pipeline_parallel_size})")
        self._extra = dict(kvt.kv_connector_extra_config or {})
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role is KVConnectorRole.SCHEDULER:
            model = model_of(vllm_config)
            groups = kv_cache_config.kv_cache_groups
            group_map = GroupMap.build(build_tensor_map(model, draft_layers_of(kv_cache_config)), kv_cache_config,
                                       model.num_layers)
            block_size = next(groups[g].kv_cache_spec.block_size for g, attn in
                              zip(kv_cache_config.transfer_group_ids, _attention_flags(kv_cache_config), strict=True)
                              if attn)
            # A bad setting (its highest rank port included) fails the engine at start, not later.
            config = rank_config(vllm_config, self._extra, vllm_config.parallel_config.tensor_parallel_size - 1)
            self._scheduler = SchedulerSide(vllm_config, kv_cache_config, group_map, block_size,
                                            secret=load_secret(config.secret_file))

    # ==== worker side ==================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap vLLM's allocation (no copy) and open this rank's NIXL agent(s)."""
        tp_rank = tensor_parallel_rank()
        engine = wrap_engine_cache(self._vllm_config, self._kv_cache_config, kv_caches, tp_rank)
        kvt = self._kv_transfer_config
        g = engine.cache.geometry
        # What decides every read's bytes; a pair that differs in any of these is refused at the handshake.
        log.info("hybrid-transfer: TP rank %d cache: %d-token blocks, %d-token kernel pages, page interior %s, "
                 "conv layout %s, %d blocks", tp_rank, g.block_size, g.kernel_block_size, g.kv_interior,
                 g.conv_layout.value, engine.cache.num_blocks)
        self._worker = WorkerSide(engine, rank_config(self._vllm_config, self._extra, tp_rank), engine_id=kvt.engine_id,
                                  incarnation=incarnation_of(self._vllm_config), is_producer=kvt.is_kv_producer,
                                  is_consumer=kvt.is_kv_consumer)
        if self._worker.producer is not None:  # what an operator checks a port plan against (docs/dep.md)
            log.info("hybrid-transfer: engine %s (data_parallel_index %d) TP rank %d: side channel bound on %s, "
                     "advertised as %s", kvt.engine_id, self._vllm_config.parallel_config.data_parallel_index, tp_rank,
                     self._worker.config.side_channel_host, self._worker.producer.address)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self._worker.card() if self._worker is not None else None

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, HybridConnectorMetadata)
        self._worker.start(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """No-op: reads land between steps (pull model), never during a forward."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """No-op: decode reads the blocks where they are."""

    def wait_for_save(self) -> None:
        """No-op: nothing is pushed."""

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, recving, failed = self._worker.results()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Always empty: vLLM 0.33 refuses block-level errors for hybrids; failures go by request."""
        return set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This rank's transfers since the last step (stats.py); None on the scheduler side or when nothing happened."""
        return self._worker.stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()

    # ==== scheduler side ===============================================================
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return self._scheduler.get_loaded_kv_cache_group_ids()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build_connector_meta(scheduler_output)

    def on_new_request(self, request: Request) -> None:
        self._scheduler.on_new_request(request)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        raise UnsupportedError("HybridNixlConnector needs vLLM's hybrid memory allocator (request_finished_all_groups)")

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        if params and params.get(kvp.DO_REMOTE_DECODE):
            return self._scheduler.finished_prefill(request, block_ids)
        if params:
            self._scheduler.finished_decode(request)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keep an idle engine stepping while it holds blocks for decode engines.

        A prefill engine with nothing to compute does not step, and its workers act on completions,
        declines and lease expiries only in a step (``get_transfer_results``): held blocks then stayed
        pinned until the next request arrived (seen in the real-engine suite). vLLM steps while this is
        True (0.32 and 0.33 ``Scheduler.has_requests``); the steps are empty and end with the last hold.
        """
        return self._scheduler is not None and self._scheduler.holds_blocks()

    def take_events(self):
        return ()

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        cards = {rank: decode_rank_card(meta.card) for rank, meta in metadata.items() if isinstance(meta, HandshakeCard)}
        if cards:  # a decode-only engine's workers publish none
            self._scheduler.set_card(EngineCard.from_ranks(cards))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """vLLM's front end rebuilds each step's stats from their plain ``data`` (docs/metrics.md#vllm)."""
        return HybridKVConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        """The connector's series on vLLM's /metrics (docs/metrics.md#vllm)."""
        return HybridPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return REQUIRED_LAYOUT

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config) -> bool:
        """No: NIXL holds registrations of the memory wrapped at register_kv_caches; a remap would strand them."""
        return False


def _attention_flags(kv_cache_config: KVCacheConfig) -> list[bool]:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return [isinstance(kv_cache_config.kv_cache_groups[g].kv_cache_spec, FullAttentionSpec)
            for g in kv_cache_config.transfer_group_ids]
