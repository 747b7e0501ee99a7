"""vLLM's defaults turn prefix caching on, which gives a hybrid model's GDN state ``mamba_cache_mode='align'``:
the connector refuses it at engine start with the flag that fixes it (issue 26 Deliver 5)."""

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


def test_prefix_cachings_align_mode_is_refused_naming_the_flag(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=64, kv_role="kv_both")
    kvc = _with_mamba(make_kv_cache_config(cfg, 16), mamba_cache_mode="align")
    with pytest.raises(UnsupportedError, match="--no-enable-prefix-caching") as info:
        engine_rank_spec(kvc, _attention_view())
    assert "'align'" in str(info.value)


def test_speculative_state_blocks_are_refused_naming_the_setting(model_dir):
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=64, kv_role="kv_both")
    kvc = _with_mamba(make_kv_cache_config(cfg, 16), num_speculative_blocks=2)
    with pytest.raises(UnsupportedError, match="--speculative-config"):
        engine_rank_spec(kvc, _attention_view())


def _attention_view():
    import torch

    return torch.zeros(1, 1, 64, 1)
