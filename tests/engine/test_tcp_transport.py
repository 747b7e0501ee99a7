"""Real transfers over UCX's TCP path (issue 21, item 7): what between two hosts would move over the network.

On one host UCX picks shared memory (cma) for a READ between two processes; here every rank process
starts with ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES`` = the first non-loopback interface, so the bytes go
through the TCP stack on that interface (docs/between-hosts.md). The transfers are marked ``netns``:
they run in a network namespace the wrapper test at the end makes for them (tests/netns.py), where
that interface is an end of a veth pair and no byte leaves the namespace. Producers bind the side channel to the
wildcard and advertise the interface's IPv4 address; consumers allow only that address. With no such
interface the module fails (it never skips). UCX prints its protocol tables (``UCX_PROTO_INFO=y``) into
one log per process, and the last test stops the processes and reads them back: every READ a rank posted went over tcp on that
interface. This module spawns its own three rank processes (the session cluster keeps shared memory).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
from harness import TINY, Cluster, RankSpec, hold_everywhere, start_consumers, start_producers
from netns import interface
from pack_ops import run_pack
from test_transfer import _layouts

from hybrid_transfer.doctor.ucx_tables import parse_proto_tables
from hybrid_transfer.engine import EngineConfig
from hybrid_transfer.engine.tcp_path import environment, tcp_only_env
from hybrid_transfer.layout import CacheOptions, KVLayout
from hybrid_transfer.plan.types import PlanMode

NUM_WORKERS = 3  # a 1 -> 2 and a 2 -> 1 pair
NUM_BLOCKS = 64
TOKENS = [37, 64, 1, 0, 100]  # partial last blocks, a whole-block count, one token, zero tokens


@pytest.fixture(scope="module")
def tcp():
    """(cluster, interface, UCX log folder): rank processes whose UCX may use TCP on one interface only."""
    iface = interface()  # the namespace's veth end; ConfigError, naming what it saw, where there is none
    log_dir = Path(os.environ.get("HT_TCP_LOG_DIR") or _fresh_dir())
    env = {**tcp_only_env(iface.name), "UCX_PROTO_INFO": "y",
           "UCX_LOG_FILE": str(log_dir / "ucx.%p.log")}  # UCX expands %p to the process id
    # Spawned, not forked from the fork server the other engine tests use (harness.worker_context): that server
    # loaded UCX's libraries once, and UCX's log file is set up then; spawned workers each start UCX afresh in
    # the parent's environment as it is when they start, writing one log per process.
    with environment(env):
        cluster = Cluster(NUM_WORKERS, mp.get_context("spawn"))
    try:
        yield cluster, iface, log_dir
    finally:
        cluster.close()


def _fresh_dir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="ht-tcp-")


def _configs(iface, mode: PlanMode, **extra) -> tuple[EngineConfig, EngineConfig]:
    producer = EngineConfig(mode=mode, side_channel_host="0.0.0.0", side_channel_port=0, advertise_host=iface.ipv4,
                            **extra)
    consumer = EngineConfig(mode=mode, allowed_producers=(f"{iface.ipv4}/32",), **extra)
    return producer, consumer


def _move(cluster, iface, prefill_tp: int, decode_tp: int, opts: CacheOptions | None, mode: PlanMode) -> list[str]:
    """Hold TOKENS on a prefill engine, read them on a decode engine, check every byte; producer addresses."""
    p_config, c_config = _configs(iface, mode)
    p_specs = [RankSpec(TINY, prefill_tp, r, NUM_BLOCKS, opts) for r in range(prefill_tp)]
    c_specs = [RankSpec(TINY, decode_tp, r, NUM_BLOCKS, opts) for r in range(decode_tp)]
    producers = start_producers(cluster.workers[:prefill_tp], p_specs, p_config)
    consumers = start_consumers(cluster.workers[prefill_tp:prefill_tp + decode_tp], c_specs, c_config)
    try:
        rng = np.random.default_rng(7)
        remote = _layouts(p_specs[0].geometry(), TOKENS, NUM_BLOCKS, rng, extra=0)
        local = _layouts(c_specs[0].geometry(), TOKENS, NUM_BLOCKS, rng, extra=1)
        ids = [f"tcp-{i}" for i in range(len(TOKENS))]
        tickets = [hold_everywhere(producers, rid, lay, seed=500 + i)
                   for i, (rid, lay) in enumerate(zip(ids, remote, strict=True))]
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            for ticket, lay in zip(tickets, local, strict=True):
                w.call("start_read", k, ticket, lay.block_ids, lay.num_tokens)
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            results = w.call("wait_done", k, ids, 60.0)
            assert [r.state for r in results] == ["done"] * len(ids), results
            assert sum(r.num_bytes for r in results) > 0
        for w, k in zip(producers.workers, producers.keys, strict=True):
            assert w.call("wait_freed", k, ids, 30.0) == sorted(ids)
        for w, k in zip(consumers.workers, consumers.keys, strict=True):
            w.call("check", k, [(lay, 500 + i) for i, lay in enumerate(local)], mode is PlanMode.NAIVE)
        return producers.addresses
    finally:
        producers.close()
        consumers.close()


@pytest.mark.netns
def test_interleaved_layout_fans_out_1_to_2_over_tcp_with_the_interface_address_advertised(tcp):
    cluster, iface, _ = tcp
    addresses = _move(cluster, iface, 1, 2, None, PlanMode.COALESCED)
    assert [a.rsplit(":", 1)[0] for a in addresses] == [f"tcp://{iface.ipv4}"]


@pytest.mark.netns
def test_split_layout_fans_in_2_to_1_over_tcp(tcp):
    cluster, iface, _ = tcp
    addresses = _move(cluster, iface, 2, 1, CacheOptions(kv_layout=KVLayout.SPLIT, block_size=32), PlanMode.NAIVE)
    assert all(a.startswith(f"tcp://{iface.ipv4}:") for a in addresses) and len(set(addresses)) == 2


@pytest.mark.netns
def test_pack_mode_stages_and_verifies_over_tcp(tcp):
    cluster, iface, _ = tcp
    p_config, c_config = _configs(iface, PlanMode.PACK, staging_bytes=1 << 20)
    results, p_status, _, _ = run_pack(cluster, 1, 2, None, None, c_config, num_blocks=NUM_BLOCKS,
                                       token_counts=tuple(TOKENS), producer_config=p_config)
    for per_rank in results:
        assert [r.num_packed_sources for r in per_rank] == [int(n > 0) for n in TOKENS], per_rank
    assert p_status[0]["stats"]["staged"] == sum(n > 0 for n in TOKENS)


@pytest.mark.netns
def test_every_read_went_over_tcp_on_the_interface(tcp, record_property):
    """After the transfers above: UCX's tables for every READ between two processes name tcp/<interface> only.

    UCX writes its log through a buffered C stream: the rank processes exit first, which flushes it.
    """
    cluster, iface, log_dir = tcp
    cluster.close()  # the fixture's close after this is a no-op
    lines = [line for p in sorted(log_dir.glob("ucx.*.log")) for line in p.read_text(errors="replace").splitlines()]
    reads = [t for t in parse_proto_tables(lines) if t.is_read and t.scope != "self"]
    assert reads, f"UCX printed no READ protocol table into {log_dir} (UCX_PROTO_INFO=y)"
    lanes = sorted({row.config for t in reads for row in t.rows})
    transports = sorted({tr for t in reads for row in t.rows for tr in row.transports})
    record_property("ucx_read_transports", transports)
    record_property("ucx_read_lanes", lanes)
    print(f"UCX READ transports over {iface.name} ({iface.ipv4}): {transports}; lanes: {lanes}")
    assert transports == ["tcp"], lanes
    assert all(f"tcp/{iface.name}" in lane for lane in lanes), lanes


def test_the_tcp_transfers_run_in_a_network_namespace_of_their_own(netns_run):
    """The tests above, in a fresh namespace with a veth pair: bytes and UCX's tables checked there."""
    netns_run()
