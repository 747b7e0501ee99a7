"""Failures in real engines: a client that leaves while its load is stalled, and a prefill engine killed
while decode engines load from it. It kills a spare prefill engine.

A loopback read of a tiny model takes under a millisecond, so each load is stalled on purpose: a prefill
engine no decode engine has linked with yet (a spare of conftest.py) has its whole process group stopped
(SIGSTOP) before decode is asked to load, so the load waits in its first handshake. (A linked engine would
not stall it: UCX reads a stopped process's memory on loopback.)
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time

import engines
import parity
import pytest

HELD = "vllm:hybrid_transfer_held_blocks"


def wait_for(what: str, check, timeout_s: float = 60.0, every_s: float = 0.5):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every_s)
    raise AssertionError(f"{what}: not within {timeout_s} s")


def open_stream(server: engines.EngineServer, body: dict) -> http.client.HTTPConnection:
    """Send a streamed completion and return the open connection without reading the answer."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    conn.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                 {"Content-Type": "application/json"})
    return conn


@pytest.fixture(scope="module")
def prompt(suite):
    return parity.prompt_set(suite.block_size)["three blocks, inside"]


def test_a_client_that_disconnects_during_a_stalled_load_leaves_no_held_block(suite, prompt):
    spare = suite.spare_a
    params = parity.hand_off(spare, [prompt])[0]
    wait_for("prefill reports the held blocks", lambda: spare.metric(HELD) > 0)
    reads = suite.decode.metric("vllm:hybrid_transfer_reads_total")
    spare.signal_group(signal.SIGSTOP)
    try:
        conn = open_stream(suite.decode, engines.completion_body(prompt, max_tokens=parity.MAX_TOKENS,
                                                                 kv_transfer_params=params))
        time.sleep(2.0)  # decode has the request and waits on the stopped prefill engine
        conn.sock.close()  # the client goes away mid-load
        conn.close()
        time.sleep(1.0)
    finally:
        spare.signal_group(signal.SIGCONT)
    # Freed by the decline once decode links, or by the spare's 20 s lease when the link failed meanwhile.
    wait_for("prefill's held blocks back to 0", lambda: spare.metric(HELD) == 0)
    assert suite.decode.metric("vllm:hybrid_transfer_reads_total") == reads  # the load never finished
    reference = parity.aggregated(suite.reference, [prompt])[0]
    got = parity.disaggregated(suite.prefill, suite.decode, [prompt])[0]
    assert parity.equal(got, reference)  # decode serves on, right


def test_a_prefill_engine_killed_mid_load_ends_those_requests_by_policy(suite, prompt):
    spare = suite.spare_b
    whole = parity.aggregated(suite.prefill, [prompt])[0]
    params = parity.hand_off(spare, [prompt, prompt])
    results: dict[str, object] = {}

    def load(name: str, server: engines.EngineServer, p: dict) -> None:
        results[name] = server.post("/v1/completions", engines.completion_body(
            prompt, max_tokens=parity.MAX_TOKENS, kv_transfer_params=p))

    spare.signal_group(signal.SIGSTOP)
    threads = [threading.Thread(target=load, args=("fail", suite.decode, params[0])),
               threading.Thread(target=load, args=("recompute", suite.faulty, params[1]))]
    for t in threads:
        t.start()
    time.sleep(2.0)  # both loads are waiting on the stopped engine
    spare.close()  # SIGKILL to the whole group
    for t in threads:
        t.join(timeout=120)
    status, out = results["fail"]
    finish = (out.get("choices") or [{}])[0].get("finish_reason")
    assert status != 200 or finish == "error", (status, out)
    status, out = results["recompute"]
    assert status == 200, out
    got = parity.outcome(out)
    assert got.finish_reason == "length" and got.tokens == whole.tokens
    # Both decode engines serve on: a plain (aggregated) request still runs.
    for server in (suite.decode, suite.faulty):
        assert parity.aggregated(server, [prompt])[0].tokens == whole.tokens
