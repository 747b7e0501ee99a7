"""What a plain run prints (issue 21 row 7): NIXL's INFO lines only when asked for, the no-secret warning
once per process and with what to do."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from hybrid_transfer.engine import auth

# A real NIXL agent with its UCX backend, created and closed in a fresh process (NIXL reads its level on import).
_AGENT = ("from hybrid_transfer.engine.agent import NixlAgent\n"
          "from hybrid_transfer.engine.config import EngineConfig\n"
          "NixlAgent('quiet-probe', EngineConfig()).close()\n")


def _agent_output(**env: str) -> str:
    environ = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"} | env
    proc = subprocess.run([sys.executable, "-c", _AGENT], capture_output=True, text=True, timeout=120, env=environ)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def test_nixl_info_lines_are_quiet_unless_asked_for():
    assert "Initialized NIXL agent" not in _agent_output()
    assert "Initialized NIXL agent" in _agent_output(NIXL_LOG_LEVEL="INFO")  # the user's choice wins


def test_the_no_secret_warning_says_what_to_do_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(auth, "_warned_open", False)
    caplog.set_level(logging.WARNING, logger="hybrid_transfer.engine.auth")
    auth.warn_if_open(None, "producer p0")
    auth.warn_if_open(None, "consumer c0")
    auth.warn_if_open(b"x" * 32, "producer p1")
    (record,) = [r for r in caplog.records if "no shared secret" in r.getMessage()]
    message = record.getMessage()
    assert message.startswith("producer p0: ")
    assert f"export {auth.SECRET_ENV}=$(openssl rand -hex 32)" in message and "EngineConfig.secret_file" in message
    assert "once per process" in message
