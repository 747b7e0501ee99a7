"""The vLLM disaggregation example's proxy hands prefill's kv_transfer_params to decode unchanged.

Only the pure request-building functions are tested: the example itself needs GPUs and vLLM.
"""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest

PROXY = Path(__file__).resolve().parents[1] / "examples" / "vllm_disagg" / "proxy.py"


@pytest.fixture(scope="module")
def proxy():
    spec = importlib.util.spec_from_file_location("vllm_disagg_proxy", PROXY)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# What a prefill engine might return: nested lists, nulls, floats, a 63-bit integer, a string
# nonce, unicode, and keys the proxy has never heard of.
PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3], [7], [8], [9]],
    "ticket": {"nonce": "9007199254740993", "engine_id": "prefill-é", "incarnation": 2**62 + 1},
    "remote_blocks_expiry_time": 1234.5,
    "tp_size": 2,
    "unknown_future_field": None,
}
PREFILL_RESPONSE = {"id": "cmpl-1", "choices": [{"text": " Paris"}], "kv_transfer_params": PARAMS}


@pytest.mark.parametrize("body", [
    {"model": "m", "prompt": "The capital of France is", "max_tokens": 32, "stream": True,
     "stream_options": {"include_usage": True}},
    {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 64},
])
def test_decode_gets_the_prefill_params_verbatim_and_the_client_request_otherwise(proxy, body):
    original = copy.deepcopy(body)
    response = json.loads(json.dumps(PREFILL_RESPONSE))  # as parsed off the wire
    out = proxy.decode_body(body, response)
    # through JSON both ways, as the proxy sends it
    sent = json.loads(json.dumps(out))
    assert sent["kv_transfer_params"] == PARAMS
    assert json.dumps(sent["kv_transfer_params"], sort_keys=True) == json.dumps(PARAMS, sort_keys=True)
    assert {k: v for k, v in sent.items() if k != "kv_transfer_params"} == original
    assert body == original, "the client's request must not be modified"
    assert response == PREFILL_RESPONSE, "the prefill answer must not be modified"


def test_prefill_asks_for_one_token_without_streaming_and_a_remote_decode(proxy):
    body = {"model": "m", "messages": [], "max_tokens": 99, "max_completion_tokens": 99, "stream": True,
            "stream_options": {"include_usage": True}, "kv_transfer_params": {"stale": 1}, "temperature": 0.3}
    original = copy.deepcopy(body)
    out = proxy.prefill_body(body)
    assert out["max_tokens"] == 1 and out["max_completion_tokens"] == 1
    assert out["stream"] is False and "stream_options" not in out
    assert out["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert out["temperature"] == 0.3 and out["messages"] == []
    assert body == original


@pytest.mark.parametrize("response", [{"id": "x"}, {"kv_transfer_params": None}, {"kv_transfer_params": {}}])
def test_a_prefill_answer_without_params_is_refused(proxy, response):
    with pytest.raises(proxy.ProxyError, match="kv_transfer_params"):
        proxy.decode_body({"prompt": "p"}, response)
