"""bench/transport.py and `bench --transport tcp`: the rank processes' UCX limited to TCP, bytes verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from netns import interface

from hybrid_transfer.bench import transport
from hybrid_transfer.bench.spec import BenchSpec, Device
from hybrid_transfer.doctor.ucx_tables import parse_proto_tables
from hybrid_transfer.engine.tcp_path import first_network_interface
from hybrid_transfer.errors import ConfigError

TIMEOUT_S = 300


def test_tcp_sets_ucx_only_while_spawning_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "sm")
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    iface = first_network_interface()
    with transport.rank_environment("tcp") as env:
        assert env == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": iface.name}
        assert os.environ["UCX_TLS"] == "tcp" and os.environ["UCX_NET_DEVICES"] == iface.name
    assert os.environ["UCX_TLS"] == "sm" and "UCX_NET_DEVICES" not in os.environ
    with transport.rank_environment("shm") as env:
        assert env == {} and os.environ["UCX_TLS"] == "sm"
    assert transport.describe("shm") == {"transport": "shm", "UCX_TLS": "sm"}


@pytest.mark.parametrize(("fields", "match"), [({"transport": "rdma"}, "'rdma'"),
                                               ({"transport": "tcp", "device": Device.CUDA}, "CPU only")])
def test_a_bad_transport_is_refused_naming_it(fields, match):
    with pytest.raises(ConfigError, match=match) as err:
        BenchSpec(**fields).validate()
    assert err.value.field == "transport"


@pytest.mark.netns
def test_bench_transport_tcp_moves_verified_bytes_over_tcp_on_the_interface(tmp_path):
    """Each variant's READs (chosen mode, naive, ceiling) go over tcp/<interface>, read back from UCX's tables.

    In its own network namespace (tests/netns.py), where the bench's first interface is an end of a veth pair.
    """
    iface = interface()
    out = tmp_path / "bench.json"
    env = {**os.environ, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(tmp_path / "ucx.%p.log")}
    proc = subprocess.run([sys.executable, "-m", "hybrid_transfer", "bench", "--transport", "tcp", "--tokens", "64",
                           "--requests", "2", "--warmup", "0", "--verify", "--json", str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["verified"] is True
    assert result["host"]["ucx"] == {"transport": "tcp", "UCX_TLS": "tcp", "UCX_NET_DEVICES": iface.name}
    assert result["gbps"] > 0 and result["ceiling_gbps"] > 0
    lines = [line for p in sorted(tmp_path.glob("ucx.*.log")) for line in p.read_text(errors="replace").splitlines()]
    reads = [t for t in parse_proto_tables(lines) if t.is_read and t.scope != "self"]
    assert reads, "UCX printed no READ table in the rank processes"
    assert sorted({row.config for t in reads for row in t.rows}) == [f"tcp/{iface.name}"]


def test_the_tcp_bench_runs_in_a_network_namespace_of_its_own(netns_run):
    netns_run()
