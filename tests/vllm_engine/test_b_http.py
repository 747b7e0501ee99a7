"""``vllm serve`` engines behind the example proxy (examples/vllm_disagg/proxy.py), over HTTP.

A completion through the proxy (streamed and not) decodes as the same-split reference; a hostile
``kv_transfer_params`` sent straight to a decode engine ends that request by the engine's
``kv_load_failure_policy`` and the next honest request still decodes right; decode's ``/metrics``
counts the connector's transfers, bytes included; one disaggregated request's TTFT against the
aggregated engine's, measured in the same run.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
import urllib.request

import engines
import parity
import pytest
from tiny_weights import CONFIG

PROXY = engines.REPO / "examples" / "vllm_disagg" / "proxy.py"
TICKET = "hybrid_transfer_ticket"
KV_BYTES_PER_TOKEN = 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 2  # K and V, bf16, one attention layer


@pytest.fixture(scope="module")
def proxy(suite):
    port = engines.free_port()
    log = open(suite.root / "proxy.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, str(PROXY), "--prefill", suite.prefill.url, "--decode", suite.decode.url,
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/v1/completions", timeout=1)
        except urllib.error.HTTPError:
            break  # it answers (a GET is not a route)
        except OSError:
            time.sleep(0.2)
    yield url
    proc.kill()
    proc.wait(timeout=10)
    log.close()


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def stream(url: str, body: dict) -> tuple[list[int], float]:
    """Token ids of a streamed completion and the seconds to its first token."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                tokens = (choice.get("logprobs") or {}).get("tokens") or []
                if tokens and ttft is None:
                    ttft = time.perf_counter() - t0
                ids += [int(t.split(":", 1)[1]) for t in tokens]
    return ids, ttft


@pytest.fixture(scope="module")
def prompt(suite):
    return parity.prompt_set(suite.block_size)["two blocks, inside"]


@pytest.fixture(scope="module")
def reference(suite, prompt):
    return parity.aggregated(suite.reference, [prompt])[0]


def test_a_completion_through_the_proxy_decodes_as_the_same_split(proxy, prompt, reference):
    body = engines.completion_body(prompt, max_tokens=parity.MAX_TOKENS)
    got = parity.outcome(post(proxy, body))
    assert parity.equal(got, reference), (got.tokens, reference.tokens)
    streamed, _ = stream(proxy, body)
    assert streamed == reference.tokens


def test_the_ttft_of_a_disaggregated_request_against_aggregated(suite, proxy, prompt):
    """Measured, not asserted: written to ttft.json and printed (the closing note's ratio)."""
    body = engines.completion_body(prompt, max_tokens=parity.MAX_TOKENS)
    rounds = []
    for _ in range(3):
        _, disagg = stream(proxy, body)
        _, agg = stream(suite.prefill.url, body)  # the whole prompt on one engine
        rounds.append((disagg, agg))
    disagg = sorted(d for d, _ in rounds)[1]
    agg = sorted(a for _, a in rounds)[1]
    report = {"prompt_tokens": len(prompt), "disaggregated_ttft_s": disagg, "aggregated_ttft_s": agg,
              "ratio": disagg / agg, "rounds": rounds}
    (suite.root / "ttft.json").write_text(json.dumps(report, indent=1))
    print(f"\nTTFT (median of 3, {len(prompt)} prompt tokens): disaggregated {disagg * 1e3:.1f} ms, "
          f"aggregated {agg * 1e3:.1f} ms, ratio {disagg / agg:.2f}")
    assert disagg > 0 and agg > 0


def hostile_variants(params: dict) -> dict[str, dict]:
    forged = copy.deepcopy(params)
    forged[TICKET]["block_ids"] = [[0] * len(g) for g in forged[TICKET]["block_ids"]]  # another request's blocks
    garbage = copy.deepcopy(params)
    garbage[TICKET] = "not a ticket"
    lying = copy.deepcopy(params)
    lying[TICKET]["num_tokens"] = lying[TICKET]["num_tokens"] + 64  # more tokens than prefill computed
    return {"forged block ids": forged, "garbage ticket": garbage, "num_tokens changed": lying}


def test_hostile_params_fail_the_request_under_policy_fail_and_the_engine_serves_on(suite, prompt, reference):
    honest = parity.hand_off(suite.prefill, [prompt])[0]
    for name, params in hostile_variants(honest).items():
        status, out = suite.decode.post("/v1/completions", engines.completion_body(
            prompt, max_tokens=parity.MAX_TOKENS, kv_transfer_params=params))
        finish = (out.get("choices") or [{}])[0].get("finish_reason")
        assert status != 200 or finish == "error", f"{name}: HTTP {status}, finish {finish}: {out}"
    # The honest params still load (a refused forgery of them freed nothing), and decode right.
    got = parity.outcome(suite.decode.complete(prompt, max_tokens=parity.MAX_TOKENS, kv_transfer_params=honest))
    assert parity.equal(got, reference)


def test_hostile_params_recompute_under_policy_recompute(suite, prompt, reference):
    whole = parity.aggregated(suite.prefill, [prompt])[0]  # recompute runs the whole prompt at once
    honest = parity.hand_off(suite.prefill, [prompt])[0]
    for name, params in hostile_variants(honest).items():
        got = parity.outcome(suite.faulty.complete(prompt, max_tokens=parity.MAX_TOKENS, kv_transfer_params=params))
        assert got.finish_reason == "length", name
        assert got.tokens == whole.tokens, (name, got.tokens, whole.tokens)
    got = parity.outcome(suite.faulty.complete(prompt, max_tokens=parity.MAX_TOKENS, kv_transfer_params=honest))
    assert parity.equal(got, reference)


def test_decode_metrics_count_each_load_and_its_bytes(suite):
    """Over HTTP /metrics: one more read per load; whole kernel pages move (N-1 = 1 and 2 cost the same,
    one block more costs exactly a block of K|V)."""
    b = suite.block_size
    moved = {}
    for n_minus_1 in (1, 2, b + 1):
        before = (suite.decode.metric("vllm:hybrid_transfer_reads_total"),
                  suite.decode.metric("vllm:hybrid_transfer_read_bytes_total"))
        parity.disaggregated(suite.prefill, suite.decode, [list(range(7, 8 + n_minus_1))])
        deadline = time.monotonic() + 20  # stats reach the API server with the engine's periodic update
        while time.monotonic() < deadline:
            after = (suite.decode.metric("vllm:hybrid_transfer_reads_total"),
                     suite.decode.metric("vllm:hybrid_transfer_read_bytes_total"))
            if after[0] > before[0]:
                break
            time.sleep(0.5)
        assert after[0] == before[0] + 1, (before, after)
        moved[n_minus_1] = after[1] - before[1]
    assert moved[1] == moved[2] > 0
    assert moved[b + 1] - moved[1] == b * KV_BYTES_PER_TOKEN
