"""A minimal prefill/decode proxy for two ``vllm serve`` engines running hybrid_transfer's connector.

Per request (``/v1/completions`` or ``/v1/chat/completions``):
  1. send the prompt to the prefill engine with ``max_tokens=1``, no streaming, and
     ``kv_transfer_params={"do_remote_decode": true}``: the prefill engine computes the prompt's
     cache, keeps its blocks and answers with the ``kv_transfer_params`` a decode engine needs;
  2. send the client's original request to the decode engine with exactly those
     ``kv_transfer_params``, byte for byte as JSON values, and relay its answer (streamed or not).

The proxy never reads or changes the params: they are the connector's business (what is inside is
documented with the connector). Standard library only; one thread per client connection.

  python examples/vllm_disagg/proxy.py --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("vllm_disagg.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False}


class ProxyError(Exception):
    """The prefill engine's answer cannot be handed to the decode engine."""


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
    prefill_url = "http://127.0.0.1:8100"
    decode_url = "http://127.0.0.1:8200"
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
        try:
            with _post(self.prefill_url + self.path, prefill_body(body), self.timeout_s) as resp:
                prefilled = json.loads(resp.read())
            downstream = _post(self.decode_url + self.path, decode_body(body, prefilled), self.timeout_s)
        except urllib.error.HTTPError as exc:
            self._reply(exc.code, {"error": exc.read().decode(errors="replace")})
            return
        except (urllib.error.URLError, ProxyError, OSError) as exc:
            self._reply(502, {"error": str(exc)})
            return
        with downstream:
            self.send_response(downstream.status)
            self.send_header("Content-Type", downstream.headers.get("Content-Type", "application/json"))
            self.end_headers()
            while chunk := downstream.read1(65536):  # relays a stream as it arrives
                self.wfile.write(chunk)
                self.wfile.flush()

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", default=Handler.prefill_url, help="prefill engine base URL")
    parser.add_argument("--decode", default=Handler.decode_url, help="decode engine base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=Handler.timeout_s, help="per upstream call, seconds")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    Handler.prefill_url, Handler.decode_url = args.prefill.rstrip("/"), args.decode.rstrip("/")
    Handler.timeout_s = args.timeout
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    log.info("proxy on %s:%d: prefill %s, decode %s", args.host, args.port, Handler.prefill_url, Handler.decode_url)
    server.serve_forever()


if __name__ == "__main__":
    main()
