"""`doctor --serve` / `doctor --peer` over loopback: real processes, real NIXL agents, real bytes (issue 21, item 8)."""

from __future__ import annotations

import json
import os
import re
import select
import subprocess
import sys
import time

import pytest
from netns import interface

from hybrid_transfer.cli import main
from hybrid_transfer.engine.tcp_path import tcp_only_env

SECRET = "doctor-peer-test-secret-0123456789"
LISTEN_WAIT_S = 60.0  # the server prints its port once its agent and buffer exist (NIXL import included)
RUN_S = 120.0


def _env(secret: str | None, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HYBRID_TRANSFER_SECRET" and not k.startswith("UCX_")}
    if secret is not None:
        env["HYBRID_TRANSFER_SECRET"] = secret
    return {**env, **extra}


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "hybrid_transfer", "doctor", *args]


class _Server:
    """A `doctor --serve` subprocess; ``port`` is read from its "listening on HOST:PORT" line."""

    def __init__(self, host: str, env: dict[str, str], timeout_s: float = 60.0):
        self.proc = subprocess.Popen(_cli("--serve", "--host", host, "--port", "0", "--bytes", "1M", "--timeout",
                                          str(timeout_s), "--json"),
                                     env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.stderr = b""
        deadline = time.monotonic() + LISTEN_WAIT_S
        while (match := re.search(rb"listening on (\S+):(\d+)", self.stderr)) is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.proc.stderr], [], [], remaining)[0]:
                self.proc.kill()
                raise AssertionError(f"doctor --serve printed no port: {self.stderr.decode(errors='replace')}")
            chunk = os.read(self.proc.stderr.fileno(), 4096)
            if not chunk:
                raise AssertionError(f"doctor --serve exited early: {self.stderr.decode(errors='replace')}")
            self.stderr += chunk
        self.address = f"{match.group(1).decode()}:{match.group(2).decode()}"

    def finish(self) -> tuple[int, dict]:
        out, err = self.proc.communicate(timeout=RUN_S)
        assert out, (self.stderr + err).decode(errors="replace")
        return self.proc.returncode, json.loads(out)


def _peer(address: str, env: dict[str, str]) -> tuple[int, dict[str, dict]]:
    done = subprocess.run(_cli("--peer", address, "--timeout", "60", "--json"), env=env, capture_output=True,
                          timeout=RUN_S)
    assert done.stdout, done.stderr.decode(errors="replace")
    return done.returncode, {c["name"]: c for c in json.loads(done.stdout)["checks"]}


def test_serve_refuses_a_peer_without_the_secret_then_measures_one_with_it_over_loopback():
    server = _Server("127.0.0.1", _env(SECRET))
    try:
        code, checks = _peer(server.address, _env(None))
        assert code == 1 and checks["peer_link"]["status"] == "fail", checks
        assert "requires the shared secret" in checks["peer_link"]["detail"]
        assert "HYBRID_TRANSFER_SECRET" in checks["peer_link"]["fix"]
        assert set(checks) == {"peer_link"}  # nothing was read

        code, checks = _peer(server.address, _env("another-secret-of-enough-bytes"))
        assert code == 1 and "does not match" in checks["peer_link"]["detail"], checks

        code, checks = _peer(server.address, _env(SECRET))
        assert code == 0, checks
        assert checks["peer_link"]["data"]["secret"] is True
        assert checks["peer_bandwidth"]["data"]["verified"] is True and checks["peer_bandwidth"]["data"]["gbps"] > 0
        assert checks["peer_latency"]["data"]["latency_us"] > 0
        assert checks["peer_transports"]["status"] == "pass" and checks["peer_transports"]["data"]["transports"]
    finally:
        serve_code, report = server.finish()
    assert serve_code == 0, report
    (served,) = report["checks"]
    assert served["status"] == "pass" and served["data"]["refused"] == 2 and served["data"]["verified"] is True


@pytest.mark.netns
def test_peer_names_tcp_when_ucx_is_limited_to_the_interface_the_server_binds():
    """The between-hosts case on one host: UCX may use only TCP on the first network interface, on both sides.

    In its own network namespace (tests/netns.py): that interface is an end of a veth pair there.
    """
    iface = interface()
    env = _env(None, **tcp_only_env(iface.name))
    server = _Server(iface.ipv4, env)
    try:
        assert server.address.startswith(f"{iface.ipv4}:")
        code, checks = _peer(server.address, env)
    finally:
        serve_code, _ = server.finish()
    assert code == 0 and serve_code == 0, checks
    transports = checks["peer_transports"]["data"]
    assert transports["transports"] == ["tcp"], transports
    assert all(f"tcp/{iface.name}" in lane for lanes in transports["lanes"].values() for lane in lanes), transports


def test_serve_without_a_peer_exits_after_its_timeout():
    server = _Server("127.0.0.1", _env(None), timeout_s=1.0)
    code, report = server.finish()
    assert code == 1
    assert report["checks"][0]["status"] == "fail" and "no peer finished within 1 s" in report["checks"][0]["detail"]


def test_serve_needs_an_explicit_host_and_says_so_before_binding(capsys):
    assert main(["doctor", "--serve", "--port", "0"]) == 2
    assert "--serve needs an explicit --host" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["no-port", "host:99999", "tcp://", "[::1"])
def test_a_bad_peer_address_is_one_line_naming_it(capsys, bad):
    assert main(["doctor", "--peer", bad]) == 2
    err = capsys.readouterr().err
    assert repr(bad) in err and err.count("\n") == 1


def test_the_tcp_limited_pair_runs_in_a_network_namespace_of_its_own(netns_run):
    netns_run()
