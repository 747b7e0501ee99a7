"""tests/netns.py: the namespace the TCP-path tests run in, and the wrapper's loud failures (never a skip)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from types import SimpleNamespace

import netns
import pytest

INSIDE_CHECK = '''
import os
import socket

import pytest


@pytest.mark.netns
def test_only_lo_and_the_veth_pair():
    assert os.environ["HT_TEST_NETNS"] == "1"
    assert sorted(name for _, name in socket.if_nameindex()) == ["hta", "htb", "lo"]
    assert sorted(os.listdir("/sys/class/net")) == ["hta", "htb", "lo"]  # what UCX lists
'''


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "test_child.py"
    path.write_text(body)
    return path


def test_a_child_sees_only_lo_and_the_veth_pair_and_the_host_keeps_its_interfaces(tmp_path):
    host = os.listdir("/sys/class/net")
    assert netns.run_in_namespace(_write(tmp_path, INSIDE_CHECK), expected=1)["passed"] == 1
    assert os.listdir("/sys/class/net") == host  # the sysfs mount stayed in the namespace


def test_fewer_passed_than_the_file_marks_fails(tmp_path):
    with pytest.raises(AssertionError, match=r"expected >= 2 passed in test_child\.py"):
        netns.run_in_namespace(_write(tmp_path, INSIDE_CHECK), expected=2)


def test_a_failing_child_fails_the_wrapper_with_its_output(tmp_path):
    body = "import pytest\n\n\n@pytest.mark.netns\ndef test_broken():\n    assert 1 == 2, 'child says no'\n"
    with pytest.raises(AssertionError, match=r"(?s)exited 1.*child says no"):
        netns.run_in_namespace(_write(tmp_path, body), expected=1)


def test_a_child_past_its_deadline_is_killed_and_fails(tmp_path):
    body = "import time\n\nimport pytest\n\n\n@pytest.mark.netns\ndef test_hangs():\n    time.sleep(600)\n"
    with pytest.raises(AssertionError, match="ran past 1 s"):  # the child sleeps 600 s: any deadline is past
        netns.run_in_namespace(_write(tmp_path, body), expected=1, timeout_s=1)


def test_missing_tools_fail_naming_them(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no unshare, ip, mount or sh
    with pytest.raises(AssertionError, match=r"\['unshare', 'ip', 'mount', 'sh'\] not on PATH"):
        netns.run_in_namespace(tmp_path / "test_child.py", expected=1)


def test_a_namespace_that_cannot_be_made_fails_saying_so(tmp_path, monkeypatch):
    fake = tmp_path / "bin" / "unshare"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'unshare: unshare failed: Operation not permitted' >&2\nexit 1\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    with pytest.raises(AssertionError, match=r"(?s)could not make the network namespace.*Operation not permitted"):
        netns.run_in_namespace(_write(tmp_path, INSIDE_CHECK), expected=1)


@pytest.mark.parametrize(("line", "counts"), [
    ("4 passed, 1 deselected in 9.23s", {"passed": 4, "deselected": 1}),
    ("1 failed, 2 passed, 3 errors, 1 warning in 0.50s", {"failed": 1, "passed": 2, "error": 3, "warning": 1}),
    ("=== 2 skipped in 1.00s ===", {"skipped": 2}),
    ("no tests ran in 0.01s", {}),
])
def test_summary_reads_the_last_pytest_line(line, counts):
    assert netns.summary(f"collected\n3 passed in 1.0s\n{line}\n") == counts
    assert netns.summary("no summary\n") == {}


def test_deselect_keeps_netns_tests_inside_and_wrappers_outside(monkeypatch):
    def item(name, marked=False, wrapper=False):
        mark = SimpleNamespace(name="netns") if marked else None
        return SimpleNamespace(name=name, get_closest_marker=lambda _: mark,
                               fixturenames=["netns_run"] if wrapper else ["tmp_path"])

    dropped = []
    config = SimpleNamespace(hook=SimpleNamespace(pytest_deselected=lambda items: dropped.extend(items)))
    every = [item("plain"), item("tcp", marked=True), item("wrapper", wrapper=True)]
    for inside, kept in [(False, ["plain", "wrapper"]), (True, ["plain", "tcp"])]:
        monkeypatch.setenv(netns.ENV_VAR, "1") if inside else monkeypatch.delenv(netns.ENV_VAR, raising=False)
        items, dropped[:] = list(every), []
        netns.deselect(config, items)
        assert [i.name for i in items] == kept
        assert [i.name for i in dropped] == sorted({"tcp", "wrapper"} - set(kept))


def test_count_marked_counts_each_parametrized_case():
    @pytest.mark.netns
    @pytest.mark.parametrize("x", [1, 2, 3])
    def test_three(x):
        pass

    @pytest.mark.netns
    def test_one():
        pass

    def test_plain():
        pass

    module = SimpleNamespace(test_three=test_three, test_one=test_one, test_plain=test_plain, helper=test_one)
    assert netns.count_marked(module) == 4


def test_interface_refuses_to_run_outside_the_namespace(monkeypatch):
    monkeypatch.delenv(netns.ENV_VAR, raising=False)
    with pytest.raises(AssertionError, match="only inside its namespace"):
        netns.interface()
