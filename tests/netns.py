"""Tests that send traffic over a network interface run in a network namespace of their own (marker ``netns``).

A test of a server we run may send traffic only to loopback or to interfaces the test made itself. The
TCP-path tests (docs/between-hosts.md#ci) need a non-loopback interface, so they run inside a fresh
network namespace (``unshare --net --mount``) whose only interfaces are ``lo`` and a veth pair; the host's
own interfaces are not there, and every byte stays inside the namespace.

- Outside (``HT_TEST_NETNS`` unset), tests marked ``netns`` are deselected, and each file's wrapper test
  (one that takes the ``netns_run`` fixture) runs exactly that file's ``netns`` tests in a fresh namespace:
  it fails, never skips, where ``unshare``, ``ip`` or veth are missing, and it asserts the child pytest
  exited 0 and passed at least as many tests as the file marks ``netns``.
- Inside (``HT_TEST_NETNS=1``), the ``netns`` tests run and the wrappers are deselected.

The namespace also gets its own sysfs mount: UCX lists interfaces from ``/sys/class/net``, which
otherwise still shows the host's.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

MARK = "netns"
ENV_VAR = "HT_TEST_NETNS"
FIXTURE = "netns_run"
ROOT = Path(__file__).resolve().parent.parent  # the repository: the child pytest reads the same config
# The veth pair: both ends in the namespace, which has no other interface but lo, so nothing leaves it.
VETH = {"hta": "10.77.0.1", "htb": "10.77.0.2"}
TIMEOUT_S = 480.0  # one file's netns tests, pytest start included, on a busy 2-core host
_READY = "netns: namespace ready"
_SETUP = " && ".join([
    "ip link set lo up",
    "ip link add hta type veth peer name htb",
    *(f"ip addr add {addr}/24 dev {name}" for name, addr in VETH.items()),
    *(f"ip link set {name} up" for name in VETH),
    "mount -t sysfs sysfs /sys",  # the namespace's own /sys/class/net (private: unshare --mount's default)
    f"echo {_READY}",
    'exec "$@"',
])
_SUMMARY = re.compile(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|deselected|warnings?)\b")


def is_inside() -> bool:
    """Whether this process is a child the wrapper started inside a namespace."""
    return os.environ.get(ENV_VAR) == "1"


def interface():
    """The first network interface (a tcp_path.Interface), checked to be a veth end here, never a host's interface.

    Raises:
        AssertionError: not inside the namespace, or the first interface is not a veth end with its address.
    """
    from hybrid_transfer.engine.tcp_path import first_network_interface  # here: conftest imports this module

    assert is_inside(), f"a netns test runs only inside its namespace ({ENV_VAR}=1, started by its wrapper test)"
    iface = first_network_interface()
    assert VETH.get(iface.name) == iface.ipv4, f"first interface {iface} is not an end of the veth pair {VETH}"
    return iface


def deselect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """pytest_collection_modifyitems: keep the netns tests inside the namespace, their wrappers outside."""
    inside = is_inside()
    kept, dropped = [], []
    for item in items:
        is_wrapper = FIXTURE in getattr(item, "fixturenames", ())
        is_netns = item.get_closest_marker(MARK) is not None
        (dropped if (is_wrapper if inside else is_netns) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


def count_marked(module) -> int:
    """How many tests ``module`` has marked netns (a parametrized one counts each case), as pytest collects them.

    Read from the module, not the session: the wrapper may be selected alone (``file::test_name``).
    """
    total = 0
    for name, obj in vars(module).items():
        marks = getattr(obj, "pytestmark", []) if name.startswith("test") and callable(obj) else []
        if any(m.name == MARK for m in marks):
            cases = 1
            for m in marks:
                if m.name == "parametrize":
                    cases *= len(m.args[1])
            total += cases
    return total


def runner(request: pytest.FixtureRequest):
    """The ``netns_run`` fixture's value: a call that runs the requesting file's netns tests in a namespace."""
    path = request.node.path
    expected = count_marked(request.module)

    def run(timeout_s: float = TIMEOUT_S) -> dict[str, int]:
        assert expected > 0, f"{path} has no test marked {MARK!r} for its wrapper to run"
        return run_in_namespace(path, expected, timeout_s)

    return run


def command(path: Path) -> list[str]:
    """unshare + the veth setup, then this interpreter's pytest on ``path``'s netns tests."""
    return ["unshare", "--net", "--mount", "sh", "-c", _SETUP, "sh",
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", MARK, str(path)]


def summary(output: str) -> dict[str, int]:
    """The counts on pytest's last summary line ("3 passed, 2 deselected in 9.10s"); {} when there is none."""
    for line in reversed(output.splitlines()):
        found = _SUMMARY.findall(line)
        if re.search(r" in [\d.]+s\b", line) and (found or "no tests ran" in line):
            return {word.rstrip("s") if word.startswith(("error", "warning")) else word: int(n) for n, word in found}
    return {}


def run_in_namespace(path: Path, expected: int, timeout_s: float = TIMEOUT_S) -> dict[str, int]:
    """Run ``path``'s netns tests in a fresh namespace, printing the child's output as it comes; its summary.

    Raises:
        AssertionError: a tool is missing, the namespace could not be made, the child ran past ``timeout_s``,
            exited non-zero, or passed fewer than ``expected`` tests (or failed, errored or skipped any).
    """
    missing = [tool for tool in ("unshare", "ip", "mount", "sh") if shutil.which(tool) is None]
    assert not missing, f"cannot make a network namespace for {path.name}: {missing} not on PATH"
    env = {**os.environ, ENV_VAR: "1"}
    proc = subprocess.Popen(command(path), cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    lines: list[str] = []

    def pump() -> None:  # one reader thread, ends when the child's stdout closes
        for line in proc.stdout:
            lines.append(line)
            print(line, end="", flush=True)

    reader = threading.Thread(target=pump, name=f"netns-{path.stem}", daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the rank processes it spawned go too
        proc.wait(timeout=30)
        code = None
    reader.join(timeout=30)
    output = "".join(lines)
    assert code is not None, f"netns run of {path.name} ran past {timeout_s:.0f} s:\n{output[-4000:]}"
    assert _READY in output, (f"could not make the network namespace for {path.name} (exit {code}; unshare "
                              f"--net --mount needs root or CAP_SYS_ADMIN, and the kernel veth links):\n{output[-2000:]}")
    assert code == 0, f"netns tests of {path.name} exited {code}:\n{output[-4000:]}"
    counts = summary(output)
    assert counts.get("passed", 0) >= expected, f"expected >= {expected} passed in {path.name}, got {counts}"
    bad = {k: v for k, v in counts.items() if k in ("failed", "error", "skipped", "xfailed", "xpassed") and v}
    assert not bad, f"netns tests of {path.name}: {bad}"
    return counts
