"""`hybrid-transfer doctor` end to end (subprocesses, real NIXL agents) and its table rendering."""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import pytest

from hybrid_transfer.cli import build_parser
from hybrid_transfer.cli.doctor_cmd import parse_size, render
from hybrid_transfer.doctor import CheckResult, DoctorReport, Status

CHECK_NAMES = ["nixl", "ucx_backend", "transports", "loopback_dram", "loopback_vram", "cuda_ipc_read", "mapped_path",
               "side_channel_port", "progress_thread"]


def doctor(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("UCX_TLS", None)  # the host's own transports, as a user would run it
    return subprocess.run([sys.executable, "-m", "hybrid_transfer", "doctor", *args], capture_output=True,
                          text=True, timeout=120, env=env)


def test_json_document_on_stdout():
    proc = doctor("--json")
    doc = json.loads(proc.stdout)  # nothing but the one document: UCX's and NIXL's prints went to stderr
    assert set(doc) == {"checks", "ok"}
    assert [c["name"] for c in doc["checks"]] == CHECK_NAMES
    for check in doc["checks"]:
        assert set(check) == {"name", "status", "detail", "fix", "data"}
        assert check["status"] in ("pass", "warn", "fail")
        assert check["detail"]
        if check["status"] != "pass":
            assert check["fix"]
    by_name = {c["name"]: c for c in doc["checks"]}
    assert by_name["nixl"]["status"] == "pass"
    dram = by_name["loopback_dram"]
    assert dram["status"] == "pass" and dram["data"]["verified"] is True and dram["data"]["gbps"] > 0
    assert by_name["transports"]["data"]["dram"]["transports"]  # observed, not guessed
    assert doc["ok"] == all(c["status"] != "fail" for c in doc["checks"])
    assert proc.returncode == (0 if doc["ok"] else 1)


def test_busy_port_fails_with_exit_code_one_and_a_fix():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = doctor("--device", "cpu", "--bytes", "1M", "--port", str(port))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["check", "status", "detail"]
    assert any(line.startswith("side_channel_port") and "FAIL" in line for line in lines)
    fixes = proc.stdout.split("fixes:", 1)[1]
    assert "side_channel_port:" in fixes and str(port) in fixes


def test_help_gives_every_flag_and_default(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["doctor", "--help"])
    out = capsys.readouterr().out
    for flag in ("--json", "--device", "--host", "--port", "--bytes"):
        assert flag in out
    assert "(default: auto)" in out and "(default: 67108864)" in out


@pytest.mark.parametrize(("text", "num_bytes"), [("4096", 4096), ("16M", 16 << 20), ("64MiB", 64 << 20),
                                                 ("1g", 1 << 30), ("8KB", 8 << 10)])
def test_parse_size(text, num_bytes):
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["", "12x", "1000", "4097", "-5M", "1.5G"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_render_lists_fixes_of_non_passing_checks_only():
    report = DoctorReport(checks=(
        CheckResult(name="nixl", status=Status.PASS, detail="nixl 1.5.1"),
        CheckResult(name="cuda_ipc_read", status=Status.WARN, detail="not set", fix="export X=y"),
        CheckResult(name="side_channel_port", status=Status.FAIL, detail="in use", fix="free port 5555"),
    ))
    text = render(report, width=100)
    assert "WARN" in text and "FAIL" in text
    fixes = text.split("fixes:", 1)[1]
    assert "cuda_ipc_read: export X=y" in fixes and "side_channel_port: free port 5555" in fixes
    assert "nixl:" not in fixes
    assert text.rstrip().endswith("1 check(s) failed, 1 warning(s)")
