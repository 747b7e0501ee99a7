"""Scheduler-side decisions with vLLM's real scheduler and requests (no workers needed)."""

from __future__ import annotations

from flows import ticket_params
from vllm.v1.request import RequestStatus
from vllm_engine import make_kv_cache_config, make_request, make_scheduler, make_vllm_config, write_tiny_model

from hybrid_transfer.integrations.vllm import params as kvp
from hybrid_transfer.layout.model import LayerKind

N = 100


def test_every_transfer_group_is_loaded(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=32, kv_role="kv_consumer")
    kvc = make_kv_cache_config(cfg, 64)
    scheduler = make_scheduler(cfg, kvc)
    request = make_request("d-1", N, params=ticket_params(N - 1))
    assert scheduler.connector.get_loaded_kv_cache_group_ids(request) == kvc.transfer_group_ids == (0, 1, 2, 3)


def test_hybrid_decode_loads_n_minus_1_and_waits(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=32, kv_role="kv_consumer")
    scheduler = make_scheduler(cfg, make_kv_cache_config(cfg, 64))
    request = make_request("d-1", N, params=ticket_params(N - 1))
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (N - 1, True)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status is RequestStatus.WAITING_FOR_REMOTE_KVS and request.num_computed_tokens == N - 1
    order = out.kv_connector_metadata.reads["d-1"]
    assert order.expected_state_position == N - 1
    # Our group order: attention first; ceil(99 / 32) = 4 attention blocks cover the loaded tokens.
    assert len(order.local_block_ids) == 4 and len(order.local_block_ids[0]) >= 4
    assert all(len(ids) == 1 for ids in order.local_block_ids[1:])


def test_a_ticket_for_another_prompt_length_is_computed_locally_and_declined(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=32, kv_role="kv_consumer")
    scheduler = make_scheduler(cfg, make_kv_cache_config(cfg, 64))
    request = make_request("d-1", N, params=ticket_params(N - 5))
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status is RequestStatus.RUNNING and out.num_scheduled_tokens["d-1"] == N
    assert set(out.kv_connector_metadata.declines) == {"d-1"} and not out.kv_connector_metadata.reads


def test_attention_only_models_move_all_n_tokens(tmp_path):
    model_dir = write_tiny_model(tmp_path / "attention-only", layer_types=["full_attention"] * 8)
    p_cfg = make_vllm_config(model_dir, tp_size=1, block_size=16, kv_role="kv_producer")
    prefill = make_scheduler(p_cfg, make_kv_cache_config(p_cfg, 64))
    p_request = make_request("p-1", N, params={kvp.DO_REMOTE_DECODE: True})
    prefill.add_request(p_request)
    assert p_request.num_prompt_tokens == N and p_request.max_tokens == 1  # no N-1 cut without GDN state

    d_cfg = make_vllm_config(model_dir, tp_size=1, block_size=32, kv_role="kv_consumer")
    decode = make_scheduler(d_cfg, make_kv_cache_config(d_cfg, 64))
    d_request = make_request("d-1", N, params=ticket_params(N, group_kinds=(LayerKind.ATTENTION,)))
    assert decode.connector.get_num_new_matched_tokens(d_request, 0) == (N, True)


def test_a_malformed_ticket_is_computed_locally(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=32, kv_role="kv_consumer")
    scheduler = make_scheduler(cfg, make_kv_cache_config(cfg, 64))
    params = ticket_params(N - 1)
    params[kvp.TICKET]["nonce"] = 12345  # a JSON number, not the decimal string the codec writes
    request = make_request("d-1", N, params=params)
    assert scheduler.connector.get_num_new_matched_tokens(request, 0) == (0, False)
    scheduler.add_request(request)
    out = scheduler.schedule()
    assert request.status is RequestStatus.RUNNING and out.num_scheduled_tokens["d-1"] == N
    assert not out.kv_connector_metadata.reads
