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


# ---- several prefill / decode endpoints (DEP: several DEP2 prefill endpoints, one DEP8 decode) ----------
URLS = ("http://p0:8100", "http://p1:8100", "http://p2:8100")


def test_round_robin_takes_the_urls_in_turn(proxy):
    balancer = proxy.Balancer(URLS, "round-robin")
    picks = [balancer.acquire() for _ in range(7)]
    assert picks == [*URLS, *URLS, URLS[0]]  # in turn, whatever is in flight


def test_least_loaded_takes_the_url_with_fewest_calls_in_flight_ties_in_turn(proxy):
    balancer = proxy.Balancer([u + "/" for u in URLS])  # a trailing slash is dropped
    first = [balancer.acquire() for _ in range(3)]
    assert first == list(URLS)  # a tie of zeros: in turn
    balancer.release(URLS[1])
    assert balancer.acquire() == URLS[1]  # the only one with nothing in flight
    balancer.release(URLS[2])
    balancer.release(URLS[0])
    assert balancer.in_flight() == {URLS[0]: 0, URLS[1]: 1, URLS[2]: 0}
    assert balancer.acquire() == URLS[2]  # a tie of 0 and 0: the turn goes on after URLS[1]
    assert balancer.acquire() == URLS[0]
    with balancer.use() as url:  # all at 1: in turn again
        assert url == URLS[1] and balancer.in_flight()[url] == 2
    assert balancer.in_flight() == dict.fromkeys(URLS, 1)


@pytest.mark.parametrize(("urls", "policy", "match"), [
    ((), "least-loaded", "at least one"),
    (("http://a", "http://a/"), "least-loaded", "repeat"),
    (("http://a",), "random", "policy"),
])
def test_bad_balancer_settings_are_refused(proxy, urls, policy, match):
    with pytest.raises(ValueError, match=match):
        proxy.Balancer(urls, policy)


def test_a_release_without_a_call_in_flight_is_refused(proxy):
    balancer = proxy.Balancer(URLS[:1])
    with pytest.raises(ValueError, match="no call in flight"):
        balancer.release(URLS[0])


class _Upstream:
    """A fake engine over HTTP: records each request body; prefill answers with params naming itself."""

    def __init__(self, name: str, *, prefill: bool):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                bodies.append(body)
                answer = {"kv_transfer_params": {**PARAMS, "remote_engine_id": f"{name}_dp0"}} if prefill else \
                    {"echo": body["kv_transfer_params"]}
                data = json.dumps(answer).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name=f"fake-{name}", daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)


def test_the_proxy_spreads_requests_over_several_prefill_and_decode_endpoints(proxy):
    import threading
    import urllib.request
    from http.server import ThreadingHTTPServer

    prefills = [_Upstream(f"prefill-{i}", prefill=True) for i in range(2)]
    decodes = [_Upstream(f"decode-{i}", prefill=False) for i in range(2)]
    handler = type("H", (proxy.Handler,), {"prefill": proxy.Balancer([u.url for u in prefills], "round-robin"),
                                           "decode": proxy.Balancer([u.url for u in decodes], "round-robin"),
                                           "timeout_s": 30.0, "log_message": lambda *a: None})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="proxy", daemon=True)
    thread.start()
    try:
        answers = []
        for i in range(4):
            req = urllib.request.Request(f"http://127.0.0.1:{server.server_address[1]}/v1/completions",
                                         data=json.dumps({"model": "m", "prompt": f"p{i}", "max_tokens": 8}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=30) as resp:
                answers.append(json.loads(resp.read()))
        assert [len(u.bodies) for u in prefills + decodes] == [2, 2, 2, 2]
        issuers = [a["echo"]["remote_engine_id"] for a in answers]
        assert issuers == ["prefill-0_dp0", "prefill-1_dp0"] * 2  # each decode call carries its issuer's params
        for answer in answers:
            assert {k: v for k, v in answer["echo"].items() if k != "remote_engine_id"} == PARAMS  # verbatim
        assert all(b["kv_transfer_params"] == proxy.PREFILL_PARAMS and b["max_tokens"] == 1 for b in
                   prefills[0].bodies + prefills[1].bodies)
        assert handler.prefill.in_flight() == dict.fromkeys(handler.prefill.urls, 0)
        assert handler.decode.in_flight() == dict.fromkeys(handler.decode.urls, 0)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        for upstream in prefills + decodes:
            upstream.close()
