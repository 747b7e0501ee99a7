"""Engine test fixtures: one session-wide cluster of spawned worker processes (harness.py)."""

from __future__ import annotations

import copy

import pytest
from harness import Cluster

# The root conftest's tiny hybrid model (8 layers, 2 KV heads, 1 attention + 3 GDN groups), repeated
# here because two conftest modules cannot import each other. Pages of 1 KiB at TP1.
TINY = {
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
NUM_WORKERS = 6  # the largest topology under test, 2 -> 4 or 4 -> 2, on separate processes


@pytest.fixture
def tiny() -> dict:
    return copy.deepcopy(TINY)


@pytest.fixture(scope="session")
def cluster():
    c = Cluster(NUM_WORKERS)
    yield c
    c.close()
