"""The host decides nothing this suite computes: vLLM 0.33's host-dependent choices, each set explicitly.

vLLM's CPU platform reads the host's ISA through ``torch.cpu`` when it checks a config
(platforms/cpu.py, ``check_and_update_config``). Two of its choices reach this suite's caches:

- the SSM cache dtype (~319-338): ``auto`` becomes float32 where torch reports AVX-512-BF16 and
  stays the model dtype (bfloat16) elsewhere; the state page, the block size vLLM aligns to it and
  every descriptor length follow it. Every config the suite builds names the dtype
  (vllm_engine.make_vllm_config, naive_helpers.build_engine, vllm_peer's EngineShape), and the tests
  whose figures depend on it run with both (test_naive_counts, test_vllm_pool_trace, the byte check
  of test_vllm_nixl_peer, test_bf16 against the float32 default of the driver's engines);
- the GDN conv-state layout (~447-458): SD on AVX-512-BF16 hosts unless VLLM_SSM_CONV_STATE_LAYOUT
  is set or the connector is vLLM's own NIXL one; conftest sets DS.

A third is the CPU attention kernel's ISA (``cpu_attn._get_attn_isa``: amx, vec, vec16), which
decides the page interior the connector reads from the attention layers vLLM built
(``kv_interior_of``). vLLM picks it only when it builds those layers (or on the heterogeneous-attention
receive path), never here: no config here builds a layer, so the interior is whatever the config
declares, on every host (checked below with the rest). The other ISA read, ``import_kernels``, picks
which compiled library to load, whose kernels the suite never calls.

Each test below builds configs as vLLM resolves them on a host with AVX-512-BF16 and on an
AVX2-only one (``torch.cpu``'s answers set by ``as_host``), whatever this host is.
"""

from __future__ import annotations

import os

import naive_helpers as nh
import pytest
import torch
from vllm.v1.kv_cache_interface import MambaSpec
from vllm_engine import make_kv_cache_config, make_vllm_config

from hybrid_transfer.integrations.vllm.geometry import kv_interior_of
from hybrid_transfer.integrations.vllm_peer.model import VLLM_NIXL, EngineShape, build_configs

HOSTS = ("avx512-bf16", "avx2")  # what vLLM's CPU platform tells apart (the x86-64 hosts this suite runs on)
LAYOUT_VAR = "VLLM_SSM_CONV_STATE_LAYOUT"


def as_host(monkeypatch, host: str) -> None:
    """From now on in this test, torch reports ``host``'s ISA (vLLM asks torch.cpu at each config check)."""
    avx512 = host == "avx512-bf16"
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)


def _driver_engine(model_dir, ssm_dtype: str | None):
    kwargs = {} if ssm_dtype is None else {"ssm_dtype": ssm_dtype}
    cfg = make_vllm_config(model_dir, tp_size=1, block_size=16, kv_role="kv_both", **kwargs)
    return cfg, make_kv_cache_config(cfg, 64)


def _attention_interior(cfg, kvc) -> str:
    """The page interior the connector's worker takes from ``cfg``'s attention layers."""
    names = [n for g in kvc.kv_cache_groups if not isinstance(g.kv_cache_spec, MambaSpec) for n in g.layer_names]
    return kv_interior_of(cfg, names)


def _naive_engine(model_dir, ssm_dtype: str | None):
    engine = nh.build_engine(nh.QWEN35_08B, 1, 12, ssm_dtype=ssm_dtype)
    return engine.vllm_config, engine.kv_cache_config


def _peer_engine(model_dir, ssm_dtype: str | None):
    return build_configs(VLLM_NIXL, "kv_both", EngineShape("qwen3.5-0.8b", 600, num_blocks=16, max_num_seqs=2,
                                                           ssm_dtype=ssm_dtype))


BUILDERS = {"driver": _driver_engine, "naive": _naive_engine, "peer": _peer_engine}


def cache_figures(kvc) -> dict:
    """What a test computes from or compares against: per group its spec's block, page and state dtypes; the tensors."""
    return {
        "groups": [(type(g.kv_cache_spec).__name__, g.kv_cache_spec.block_size, g.kv_cache_spec.page_size_bytes,
                    tuple(g.kv_cache_spec.dtypes) if isinstance(g.kv_cache_spec, MambaSpec) else None,
                    tuple(g.layer_names)) for g in kvc.kv_cache_groups],
        "tensors": [(t.size, tuple(t.layers), t.layer_stride, t.block_stride, t.offset) for t in kvc.kv_cache_tensors],
        "num_blocks": kvc.num_blocks,
    }


def _ssm_dtypes(kvc) -> set[torch.dtype]:
    return {g.kv_cache_spec.dtypes[1] for g in kvc.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)}


@pytest.mark.parametrize(("host", "expected"), [("avx512-bf16", torch.float32), ("avx2", torch.bfloat16)])
def test_an_auto_ssm_dtype_is_the_hosts_choice(monkeypatch, model_dir, host, expected):
    """Control: ``auto`` does follow the ISA ``as_host`` reports, so the test below compares two real outcomes."""
    as_host(monkeypatch, host)
    _, kvc = _driver_engine(model_dir, "auto")
    assert _ssm_dtypes(kvc) == {expected}


@pytest.mark.parametrize("ssm_dtype", [None, "float32", "bfloat16"])  # None: the builder's default
@pytest.mark.parametrize("builder", sorted(BUILDERS))
def test_the_suites_configs_resolve_alike_on_either_host(monkeypatch, model_dir, builder, ssm_dtype):
    """Every config builder of the suite gives the same caches on both hosts, with the dtype it names."""
    figures = {}
    for host in HOSTS:
        as_host(monkeypatch, host)
        cfg, kvc = BUILDERS[builder](model_dir, ssm_dtype)
        assert _ssm_dtypes(kvc) == {getattr(torch, ssm_dtype or "float32")}, host  # the models' mamba_ssm_dtype
        figures[host] = {**cache_figures(kvc), "kv_interior": _attention_interior(cfg, kvc)}
    assert figures["avx2"] == figures["avx512-bf16"]


@pytest.mark.parametrize("host", HOSTS)
def test_the_conv_state_layout_is_the_suites_setting(monkeypatch, model_dir, host):
    """conftest's DS stays DS on either host; unset, an AVX-512-BF16 host would pick SD for our connector."""
    as_host(monkeypatch, host)
    assert os.environ[LAYOUT_VAR] == "DS"
    _driver_engine(model_dir, None)
    assert os.environ[LAYOUT_VAR] == "DS"
    monkeypatch.delenv(LAYOUT_VAR)  # restored after the test, whatever vLLM writes below
    _driver_engine(model_dir, None)
    assert os.environ.get(LAYOUT_VAR) == ("SD" if host == "avx512-bf16" else None)
