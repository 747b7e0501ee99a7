"""``--mamba-ssm-cache-dtype bfloat16`` (the Qwen3.5 recipe) through vLLM's live specs and real NIXL.

Each engine names its SSM cache dtype when its config is built, as the flag does: vLLM's CPU
platform keeps an explicit float32 or bfloat16 on any host (only ``auto`` follows the host's
ISA: test_host_decisions.py). Each test asserts the dtype of vLLM's live Mamba spec before
anything else.
"""

from __future__ import annotations

import logging

import pytest
import torch
from batch_queue import state_dtype
from driver import Engine, run_until
from flows import drain, prefill
from vllm.v1.kv_cache_interface import MambaSpec

N = 100
_TORCH = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def _engine(name, model_dir, host, ssm_dtype: str, *, prefill_side: bool, **kwargs) -> Engine:
    engine = Engine(name, model_dir, [host], tp_size=1, block_size=16 if prefill_side else 32,
                    kv_role="kv_producer" if prefill_side else "kv_consumer", is_prefill=prefill_side,
                    ssm_dtype=ssm_dtype, **kwargs)
    specs = [g.kv_cache_spec for g in engine.kv_cache_config.kv_cache_groups if isinstance(g.kv_cache_spec, MambaSpec)]
    assert specs and all(spec.dtypes[1] == _TORCH[ssm_dtype] for spec in specs)  # what vLLM resolved
    return engine


@pytest.mark.parametrize("ssm_dtype", ["bfloat16", "float32"])
def test_the_geometry_follows_the_engines_ssm_dtype(model_dir, hosts, ssm_dtype):
    p = _engine("P", model_dir, hosts["prefill"], ssm_dtype, prefill_side=True)
    try:
        assert p.call("call", state_dtype) == ssm_dtype
    finally:
        p.shutdown()


def _capture(state, key):
    """Keep the worker's log records on this rank (read back with ``_captured``)."""
    records = state.__dict__.setdefault("records", [])

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("hybrid_transfer.integrations.vllm.worker").addHandler(Keep())


def _captured(state, key):
    return list(state.__dict__.get("records", ()))


def test_bf16_state_against_fp32_state_is_refused_at_the_handshake(model_dir, hosts):
    # A refused consumer has no link to decline over: the hold ends at its lease, kept short here.
    p = _engine("P", model_dir, hosts["prefill"], "float32", prefill_side=True, extra={"lease_s": 2.0})
    d = _engine("D", model_dir, hosts["decode"], "bfloat16", prefill_side=False)
    try:
        d.call("call", _capture)
        params = prefill(p, "p-mixed", N)
        request = d.add("d-mixed", N, params=params)
        failed, scheduled = [], []

        def note(engine, result):
            if engine is d:
                failed.extend(r for r in result.failed_recving if r == "d-mixed")
                scheduled.append(result.scheduled.get("d-mixed", 0))

        run_until("decode recomputes and finishes", lambda: d.status("d-mixed") is None, [d, p], on_step=note)
        assert failed == ["d-mixed"] and N in scheduled and request.num_output_tokens == 2
        refusals = [m for m in d.call("call", _captured) if "d-mixed" in m and "incompatible" in m]
        assert refusals and "ssm" in refusals[0], d.call("call", _captured)
        drain((p, d), "the unread hold ends at its lease")
    finally:
        p.shutdown()
        d.shutdown()
