"""A minimal prefill/decode proxy for ``vllm serve`` endpoints running hybrid_transfer's connector.

Per request (``/v1/completions`` or ``/v1/chat/completions``):
  1. pick a prefill endpoint and send it the prompt with ``max_tokens=1``, no streaming, and
     ``kv_transfer_params={"do_remote_decode": true}``: the prefill engine computes the prompt's
     cache, keeps its blocks and answers with the ``kv_transfer_params`` a decode engine needs;
  2. pick a decode endpoint and send it the client's original request with exactly those
     ``kv_transfer_params``, byte for byte as JSON values, and relay its answer (streamed or not).

Several prefill and decode URLs may be given (a DEP deployment: several DEP2 prefill endpoints,
one DEP8 decode endpoint; docs/dep.md); each call goes to the URL with the fewest requests in
flight from this proxy, ties in turn (``--policy least-loaded``, the default), or strictly in turn
(``round-robin``). Inside one data-parallel endpoint vLLM's API server picks the engine core.
The proxy needs no side-channel address: the params name the DP engine that issued them and its
addresses, and any decode engine reads from it.

The proxy never reads or changes the params: they are the connector's business (what is inside is
documented with the connector). Standard library only; one thread per client connection.

  python examples/vllm_disagg/proxy.py --prefill http://10.0.0.1:8100 http://10.0.0.2:8100 \\
      --decode http://10.0.0.9:8200 --port 8000
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("vllm_disagg.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}
POLICIES = ("least-loaded", "round-robin")


class ProxyError(Exception):
    """The prefill engine's answer cannot be handed to the decode engine."""


class Balancer:
    """Picks one of several endpoint URLs per call; thread-safe (the server runs a thread per connection).

    ``least-loaded``: the URL with the fewest calls of this proxy in flight, ties taken in turn;
    ``round-robin``: strictly in turn. A call holds its URL until its ``use()`` block exits.
    """

    def __init__(self, urls: Sequence[str], policy: str = "least-loaded"):
        urls = [u.rstrip("/") for u in urls]
        if not urls:
            raise ValueError("at least one endpoint URL is needed")
        if len(set(urls)) != len(urls):
            raise ValueError(f"endpoint URLs repeat: {urls}")
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
        self.urls = tuple(urls)
        self.policy = policy
        self._in_flight = dict.fromkeys(self.urls, 0)
        self._next = 0  # where the turn starts: ties and round robin go on from the last pick
        self._lock = threading.Lock()

    def acquire(self) -> str:
        with self._lock:
            order = self.urls[self._next:] + self.urls[:self._next]
            url = order[0] if self.policy == "round-robin" else min(order, key=self._in_flight.__getitem__)
            self._next = (self.urls.index(url) + 1) % len(self.urls)
            self._in_flight[url] += 1
            return url

    def release(self, url: str) -> None:
        with self._lock:
            if self._in_flight.get(url, 0) <= 0:
                raise ValueError(f"{url} has no call in flight")
            self._in_flight[url] -= 1

    @contextmanager
    def use(self) -> Iterator[str]:
        url = self.acquire()
        try:
            yield url
        finally:
            self.release(url)

    def in_flight(self) -> dict[str, int]:
        with self._lock:
            return dict(self._in_flight)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill engine's request: the client's, computing only the prompt (one token, no stream)."""
    out = copy.deepcopy(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = dict(PREFILL_PARAMS)
    return out


def decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode engine's request: the client's own, carrying the prefill answer's params verbatim."""
    params = prefill_response.get("kv_transfer_params")
    if not isinstance(params, dict) or not params:
        raise ProxyError(
            f"prefill answer carries no kv_transfer_params (got {params!r}): the prefill engine did not "
            "hand the request off; is it running with the HybridNixlConnector kv-transfer-config?"
        )
    out = copy.deepcopy(body)
    out["kv_transfer_params"] = copy.deepcopy(params)
    return out


def _post(url: str, body: dict[str, Any], timeout: float):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    return urllib.request.urlopen(req, timeout=timeout)


class Handler(BaseHTTPRequestHandler):
    prefill = Balancer(["http://127.0.0.1:8100"])
    decode = Balancer(["http://127.0.0.1:8200"])
    timeout_s = 600.0

    def do_POST(self):  # noqa: N802 (http.server's name)
        if self.path not in ROUTES:
            self._reply(404, {"error": f"unknown route {self.path}; proxied: {', '.join(ROUTES)}"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
        except (ValueError, json.JSONDecodeError) as exc:
            self._reply(400, {"error": f"request body is not JSON: {exc}"})
            return
        if not isinstance(body, dict):
            self._reply(400, {"error": f"request body is a JSON {type(body).__name__}, not an object"})
            return
        decode_url = None
        try:
            with self.prefill.use() as prefill_url, \
                    _post(prefill_url + self.path, prefill_body(body), self.timeout_s) as resp:
                prefilled = json.loads(resp.read())
            forwarded = decode_body(body, prefilled)
            decode_url = self.decode.acquire()  # held until decode's answer is relayed
            downstream = _post(decode_url + self.path, forwarded, self.timeout_s)
        except urllib.error.HTTPError as exc:
            self._release(decode_url)
            self._reply(exc.code, {"error": exc.read().decode(errors="replace")})
            return
        except (urllib.error.URLError, ProxyError, OSError, ValueError) as exc:
            self._release(decode_url)
            self._reply(502, {"error": str(exc)})
            return
        try:
            with downstream:
                self.send_response(downstream.status)
                self.send_header("Content-Type", downstream.headers.get("Content-Type", "application/json"))
                self.end_headers()
                while chunk := downstream.read1(65536):  # relays a stream as it arrives
                    self.wfile.write(chunk)
                    self.wfile.flush()
        finally:
            self._release(decode_url)

    def _release(self, decode_url: str | None) -> None:
        if decode_url is not None:
            self.decode.release(decode_url)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", nargs="+", default=list(Handler.prefill.urls),
                        help="prefill endpoint base URL(s)")
    parser.add_argument("--decode", nargs="+", default=list(Handler.decode.urls), help="decode endpoint base URL(s)")
    parser.add_argument("--policy", choices=POLICIES, default="least-loaded", help="how an endpoint is picked")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=Handler.timeout_s, help="per upstream call, seconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Handler.prefill, Handler.decode = Balancer(args.prefill, args.policy), Balancer(args.decode, args.policy)
    Handler.timeout_s = args.timeout
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    log.info("proxy on %s:%d (%s): prefill %s, decode %s", args.host, args.port, args.policy,
             " ".join(Handler.prefill.urls), " ".join(Handler.decode.urls))
    server.serve_forever()


if __name__ == "__main__":
    main()
