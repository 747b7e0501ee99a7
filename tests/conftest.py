"""Shared fixtures: a tiny hybrid model whose caches are a few KiB, so views can be checked byte by byte."""

from __future__ import annotations

import copy

import pytest

from hybrid_transfer.layout import ModelSpec, model_from_config

# 8 layers (2 full attention, 6 GDN): 2 shared tensors, 1 attention group and 3 GDN groups, like
# qwen3.5-397b-a17b in miniature. At TP1 with bf16 KV: 64 B per token, 384 B conv + 512 B ssm, block 16, page 1024.
TINY_CONFIG = {
    "num_hidden_layers": 8,
    "full_attention_interval": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 4,
    "linear_conv_kernel_dim": 4,
    "mamba_ssm_dtype": "float32",
    "dtype": "bfloat16",
}


@pytest.fixture
def tiny_config() -> dict:
    """A fresh, mutable copy of the tiny flat config."""
    return copy.deepcopy(TINY_CONFIG)


@pytest.fixture(scope="session")
def tiny_model() -> ModelSpec:
    return model_from_config(TINY_CONFIG, name="tiny")
