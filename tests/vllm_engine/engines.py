"""Real vLLM engines for the suite, each in its own process group, every one reaped at the end.

vLLM's engine-core and worker processes outlive a parent that exits without shutting the engine
down (seen: orphaned workers kept both cores busy for 20 minutes), so every engine starts in a new
session (``start_new_session``): its whole group is stopped with one signal, and ``close`` kills
the group. ``REGISTRY`` remembers every group this process started; the session fixture closes
them all and the suite's last test checks that none is left.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Listener
from pathlib import Path

HERE = Path(__file__).parent
REPO = HERE.parent.parent
START_TIMEOUT_S = 240  # an engine start takes 31-56 s alone here, two at once about 70 s
COMMAND_TIMEOUT_S = 180

REGISTRY: list[EngineProcess] = []


def engine_env(extra: dict | None = None) -> dict:
    """The environment every engine needs (docs/vllm.md#real-engines)."""
    env = dict(os.environ)
    env.update({"VLLM_SSM_CONV_STATE_LAYOUT": "DS", "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                "VLLM_TARGET_DEVICE": "cpu", "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)})
    env.update(extra or {})
    return env


class EngineError(RuntimeError):
    """An engine command failed inside the engine (the text is vLLM's or ours)."""


class EngineProcess:
    """One ``engine_child.py`` and the vLLM processes under it."""

    def __init__(self, name: str, spec: dict, *, env: dict | None = None, log_dir: Path):
        self.name = name
        authkey = secrets.token_hex(16)
        address = str(log_dir / f"{name}.sock")
        self._listener = Listener(address, authkey=authkey.encode())
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the engine
        self.proc = subprocess.Popen([sys.executable, str(HERE / "engine_child.py"), address,
                                      json.dumps({**spec, "authkey": authkey})],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=engine_env(env),
                                     start_new_session=True)
        self.pgid = self.proc.pid  # a new session: the group id is the child's pid
        REGISTRY.append(self)
        self._conn = None

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Block until the engine has started; raises EngineError with the log's tail if it failed."""
        self._listener._listener._socket.settimeout(timeout_s)
        try:
            self._conn = self._listener.accept()
        except OSError as exc:
            raise EngineError(f"{self.name} did not connect in {timeout_s} s:\n{self.log_tail()}") from exc
        self._answer(timeout_s)

    def call(self, cmd: dict, timeout_s: float = COMMAND_TIMEOUT_S):
        self._conn.send(cmd)
        return self._answer(timeout_s)

    def _answer(self, timeout_s: float):
        if not self._conn.poll(timeout_s):
            raise EngineError(f"{self.name}: no answer in {timeout_s} s:\n{self.log_tail()}")
        reply = self._conn.recv()
        if "error" in reply:
            raise EngineError(f"{self.name}: {reply['error']}\n{self.log_tail()}")
        return reply["ok"]

    def generate(self, prompts: list[list[int]], params: list[dict] | dict | None = None) -> list[dict]:
        params = params if isinstance(params, list) else [dict(params or {}) for _ in prompts]
        return self.call({"op": "generate", "prompts": prompts, "params": params})

    def log_tail(self, lines: int = 40) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the engine and every process vLLM started under it."""
        os.killpg(self.pgid, sig)

    def close(self) -> None:
        """Kill the whole group and reap the child; idempotent."""
        try:
            os.killpg(self.pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        self._listener.close()
        self._log.close()


def start_engines(specs: dict[str, tuple[dict, dict | None]], log_dir: Path) -> dict[str, EngineProcess]:
    """Start several engines side by side (each start is mostly spawning and importing) and wait for all."""
    started = {name: EngineProcess(name, spec, env=env, log_dir=log_dir) for name, (spec, env) in specs.items()}
    t0 = time.monotonic()
    for engine in started.values():
        engine.wait_ready(max(10.0, START_TIMEOUT_S - (time.monotonic() - t0)))
    return started


def live_groups() -> list[int]:
    """Process groups of this registry that still have a member (none after ``close``)."""
    alive = []
    for engine in REGISTRY:
        try:
            os.killpg(engine.pgid, 0)
            alive.append(engine.pgid)
        except ProcessLookupError:
            pass
        except PermissionError:
            alive.append(engine.pgid)
    return alive
