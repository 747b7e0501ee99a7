"""vLLM's defaults: prefix caching on, which gives a hybrid model's GDN state ``mamba_cache_mode='align'``, and
the SD conv layout (vLLM switches to DS only for connectors it knows by name). The connector takes both
(docs/vllm.md#prefix-caching, #conv-layout); a mode it does not know is refused by name."""

from __future__ import annotations

import dataclasses

import pytest
from vllm_engine import make_kv_cache_config, make_vllm_config

from hybrid_transfer.errors import UnsupportedError
from hybrid_transfer.integrations.vllm.geometry import engine_rank_spec


def _with_mamba(kvc, **changes):
    for group in kvc.kv_cache_groups:
        if hasattr(group.kv_cache_spec, "mamba_cache_mode"):
            group.kv_cache_spec = dataclasses.replace(group.kv_cache_spec, **changes)
    return kvc


def test_prefix_cachings_align_mode_is_taken(model_dir):
    """(The SD layout, vLLM's default, is proven with real engines: tests/vllm_engine/test_d_prefix_caching.py.)"""
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=64, kv_role="kv_both")
    kvc = _with_mamba(make_kv_cache_config(cfg, 16), mamba_cache_mode="align")
    spec = engine_rank_spec(kvc, _attention_view())
    assert spec.state is not None and spec.attention.block_size == 64


def test_a_mamba_cache_mode_the_connector_does_not_know_is_refused_by_name(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=64, kv_role="kv_both")
    kvc = _with_mamba(make_kv_cache_config(cfg, 16), mamba_cache_mode="all")
    with pytest.raises(UnsupportedError, match="mamba_cache_mode='all'"):
        engine_rank_spec(kvc, _attention_view())


def test_speculative_state_blocks_widen_the_conv_state_and_refuse_prefix_caching(model_dir):
    """MTP's speculative blocks (num_speculative_blocks) come with a conv state widened by as many slots: taken
    without prefix caching; with align mode, where the running state sits among them was not measured, so
    it is refused naming the flag that fixes it."""
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=64, kv_role="kv_both")
    kvc = _with_mamba(make_kv_cache_config(cfg, 16), num_speculative_blocks=2)
    spec = engine_rank_spec(kvc, _attention_view())
    assert spec.speculative_slots == 2 and spec.draft_layers == 0
    kvc = _with_mamba(kvc, mamba_cache_mode="align")
    with pytest.raises(UnsupportedError, match="--no-enable-prefix-caching"):
        engine_rank_spec(kvc, _attention_view())


def _attention_view():
    import torch

    return torch.zeros(1, 1, 64, 1)


def test_an_mtp_layer_is_a_draft_layer_after_the_models_never_model_layer_0():
    from hybrid_transfer.integrations.vllm.groups import layer_index

    assert layer_index("model.layers.0.linear_attn", 4) == 0
    assert layer_index("mtp.layers.0.self_attn.attn", 4) == 4
    assert layer_index("model.mtp.layers.1.self_attn.attn", 4) == 5
    with pytest.raises(UnsupportedError, match="MTP draft layer"):
        layer_index("mtp.layers.0.self_attn.attn")
