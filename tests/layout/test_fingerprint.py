"""Handshake fingerprint: equal across TP sizes and ranks, different for any layout or dtype change, diff names fields."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from hybrid_transfer.errors import FingerprintMismatch
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    DType,
    KVLayout,
    RankGeometry,
    SsmOrder,
    fingerprint_diff,
    fingerprint_of,
    load_preset,
)

BIG = "qwen3.5-397b-a17b"


@pytest.fixture(scope="module")
def big():
    return load_preset(BIG)


def test_same_model_at_any_tp_rank_and_block_size_has_one_fingerprint(big):
    base = fingerprint_of(RankGeometry(big, 1))
    for tp in (2, 4, 8):
        for rank in (0, tp - 1):
            fp = fingerprint_of(RankGeometry(big, tp, rank, CacheOptions(kernel_block_size=16)))
            assert fp == base
            assert fp.digest() == base.digest()
            assert fingerprint_diff(base, fp) == []


def test_fingerprint_fields(big):
    fp = fingerprint_of(RankGeometry(big, 2))
    assert fp.layer_kinds == "GGGA" * 15
    assert (fp.kv_dtype, fp.conv_dtype, fp.ssm_dtype) == ("bfloat16", "bfloat16", "float32")
    assert (fp.kv_layout, fp.conv_layout, fp.ssm_order) == ("interleaved", "DS", "nv,dv,dk")
    assert fp.layer_tensor == tuple(i // 4 for i in range(60))
    assert len(fp.digest()) == 16
    int(fp.digest(), 16)


@pytest.mark.parametrize(("options", "field", "ours", "theirs"), [
    (CacheOptions(conv_layout=ConvLayout.SD), "conv_layout", "DS", "SD"),
    (CacheOptions(ssm_order=SsmOrder.V_K_D), "ssm_order", "nv,dv,dk", "nv,dk,dv"),
    (CacheOptions(kv_dtype=DType.FP8), "kv_dtype", "bfloat16", "fp8_e4m3"),
    (CacheOptions(ssm_dtype=DType.BF16), "ssm_dtype", "float32", "bfloat16"),
    (CacheOptions(kv_layout=KVLayout.SPLIT), "kv_layout", "interleaved", "split"),
    (CacheOptions(kv_layout="split"), "kv_layout", "interleaved", "split"),
])
def test_layout_change_changes_digest_and_diff_names_field(big, options, field, ours, theirs):
    a = fingerprint_of(RankGeometry(big, 4))
    b = fingerprint_of(RankGeometry(big, 4, options=options))
    assert a.digest() != b.digest()
    assert fingerprint_diff(a, b) == [(field, ours, theirs)]


def test_n_minus_one_is_part_of_fingerprint(big):
    g = RankGeometry(big, 1)
    assert fingerprint_diff(fingerprint_of(g), fingerprint_of(g, n_minus_one=False)) == [("n_minus_one", True, False)]


def test_different_models_diff_in_declaration_order(big):
    a = fingerprint_of(RankGeometry(big, 1))
    b = fingerprint_of(RankGeometry(load_preset("qwen3-next-80b-a3b"), 1))
    names = [name for name, _, _ in fingerprint_diff(a, b)]
    assert names == ["layer_kinds", "linear_num_value_heads", "ssm_dtype", "layer_tensor"]
    err = FingerprintMismatch(fingerprint_diff(a, b))
    assert "linear_num_value_heads: ours=64 theirs=32" in str(err)
    assert "ssm_dtype: ours='float32' theirs='bfloat16'" in str(err)
    assert [d[0] for d in err.differences] == names


def test_digest_is_stable_across_processes(big):
    here = fingerprint_of(RankGeometry(big, 8)).digest()
    code = (
        "from hybrid_transfer.layout import RankGeometry, fingerprint_of, load_preset;"
        f"print(fingerprint_of(RankGeometry(load_preset('{BIG}'), 2)).digest())"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == here
