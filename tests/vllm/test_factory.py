"""vLLM's factory loads HybridNixlConnector from kv_connector_module_path, in both roles, and the
class implements every abstract hook with vLLM's own signature."""

from __future__ import annotations

import inspect
from unittest import mock

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole, SupportsHMA
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_engine import cpu, kernel_block_sizes, make_kv_cache_config, make_scheduler, make_vllm_config

from hybrid_transfer.engine.tickets import decode_rank_card
from hybrid_transfer.errors import EngineSpecMismatch, UnsupportedError
from hybrid_transfer.integrations.vllm import HybridNixlConnector
from hybrid_transfer.integrations.vllm.metadata import HandshakeCard

RANK = "hybrid_transfer.integrations.vllm.connector.tensor_parallel_rank"


def _params(fn) -> list[tuple[str, object]]:
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


def test_factory_resolves_the_class_from_the_module_path(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=16, kv_role="kv_both")
    assert KVConnectorFactory.get_connector_class(cfg.kv_transfer_config) is HybridNixlConnector
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    assert not cfg.scheduler_config.disable_hybrid_kv_cache_manager  # HMA stays on: hybrids need it


@pytest.mark.parametrize("base", [KVConnectorBase_V1, SupportsHMA])
def test_every_abstract_hook_is_implemented_with_vllms_signature(base):
    assert not inspect.isabstract(HybridNixlConnector)
    for name in sorted(base.__abstractmethods__):
        ours = getattr(HybridNixlConnector, name)
        assert ours is not getattr(base, name), name
        assert _params(ours) == _params(getattr(base, name)), name


def test_overridden_hooks_keep_vllms_signatures():
    overridden = [n for n, v in vars(HybridNixlConnector).items()
                  if callable(v) and not n.startswith("_") and hasattr(KVConnectorBase_V1, n)]
    assert {"register_kv_caches", "get_transfer_results", "get_loaded_kv_cache_group_ids", "on_new_request",
            "update_connector_output", "set_xfer_handshake_metadata", "get_handshake_metadata",
            "get_block_ids_with_load_errors", "shutdown", "take_events"} <= set(overridden)
    for name in overridden:
        theirs = getattr(KVConnectorBase_V1, name)
        ours = getattr(HybridNixlConnector, name)
        if isinstance(inspect.getattr_static(KVConnectorBase_V1, name), classmethod):
            assert isinstance(inspect.getattr_static(HybridNixlConnector, name), classmethod), name
        assert _params(ours) == _params(theirs), name


def test_both_roles_are_built_by_vllm_and_layout_is_lbhnc(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=16, kv_role="kv_both")
    kvc = make_kv_cache_config(cfg, 16)
    scheduler = make_scheduler(cfg, kvc)  # builds the scheduler-role connector through the factory
    assert isinstance(scheduler.connector, HybridNixlConnector)
    assert scheduler.connector.role is KVConnectorRole.SCHEDULER
    assert HybridNixlConnector.get_required_kvcache_layout(cfg) == "LBHNC"
    with mock.patch(RANK, return_value=0):
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
        try:
            assert worker.role is KVConnectorRole.WORKER
            worker.register_kv_caches(allocate_kv_cache(kvc, cpu(), KVCacheLayout.LBHNC, kernel_block_sizes(kvc)))
            meta = worker.get_handshake_metadata()
            assert isinstance(meta, HandshakeCard)
            card = decode_rank_card(meta.card)
            assert card.tp_rank == 0 and card.address.startswith("tcp://") and card.num_blocks == kvc.num_blocks
            assert worker.get_block_ids_with_load_errors() == set()
            scheduler.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): meta})
            assert scheduler.connector._scheduler.card.addresses == (card.address,)
        finally:
            worker.shutdown()


def test_a_resolved_layout_other_than_lbhnc_is_refused(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=16, kv_role="kv_both")
    kvc = make_kv_cache_config(cfg, 16)
    kvc.kv_cache_layout = "LBNHC"
    with mock.patch(RANK, return_value=0):
        worker = KVConnectorFactory.create_connector(cfg, KVConnectorRole.WORKER, kvc)
        with pytest.raises(UnsupportedError, match="LBNHC"):
            worker.register_kv_caches(allocate_kv_cache(kvc, cpu(), KVCacheLayout.LBNHC, kernel_block_sizes(kvc)))


def test_a_cache_that_disagrees_with_the_registry_is_refused_by_name(model_dir):
    """vLLM's specs for TP1 handed to a TP2 worker: two KV heads where the registry expects one per rank."""
    tp1 = make_vllm_config(model_dir, tp_size=1, block_size=16, kv_role="kv_both")
    kvc = make_kv_cache_config(tp1, 16)
    tp2 = make_vllm_config(model_dir, tp_size=2, block_size=16, kv_role="kv_both")
    with mock.patch(RANK, return_value=0):
        worker = KVConnectorFactory.create_connector(tp2, KVConnectorRole.WORKER, kvc)
        with pytest.raises(EngineSpecMismatch) as refused:
            worker.register_kv_caches(allocate_kv_cache(kvc, cpu(), KVCacheLayout.LBHNC, kernel_block_sizes(kvc)))
    assert "num_kv_heads" in refused.value.fields
    assert worker.get_handshake_metadata() is None  # no agent was opened
