"""Data-parallel endpoints: two prefill DP engine cores and two decode DP engine cores, every pair.

Each engine core's VllmConfig is built with ``data_parallel_size=2`` and given its identity by
vLLM's own code (``dp_engine_identity``: the ``_dp{rank}`` suffix, ``data_parallel_index``, the
independent-engine reset of ``data_parallel_rank``). Both prefill cores share one host process
and one ``kv_connector_extra_config`` with a fixed base port, as one ``vllm serve`` endpoint's
engine cores do (docs/dep.md): each rank must bind base + data_parallel_index x tp_size + tp_rank.
Every group's bytes are checked on both decode engines after the loads.
"""

from __future__ import annotations

import itertools
import os
import socket

import pytest
from driver import Engine, run_until, seed_of, through_json
from vllm_engine import make_kv_cache_config, make_scheduler, make_vllm_config

from hybrid_transfer.engine.ticket_params import ticket_from_params
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.integrations.vllm import params as kvp

DP = 2
P_TP = 2  # prefill: TP 2 per DP engine, so the offset's tp_size factor matters (ports base .. base + 3)
N = {(0, 0): 100, (0, 1): 97, (1, 0): 40, (1, 1): 130}  # (prefill dp, decode dp) -> prompt tokens
HOST_VAR = "HT_TEST_DP_ADVERTISE_HOST"  # what a deployment sets per host (docs/dep.md)


def free_port_block(count: int) -> int:
    """A base port whose ``count`` consecutive ports are free now (a fixed base, as a deployment writes one)."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        held = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                held.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in held:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports found")


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _set_env(state, key, name: str, value: str | None) -> None:
    """Run in a host process: that host's environment, as a launcher sets it before vLLM starts."""
    if value is None:
        os.environ.pop(name, None)
    else:
        os.environ[name] = value


def _is_producer(state, key) -> bool:
    """Run in a host process: whether the hosted rank runs a producer (and so binds a side-channel port)."""
    return state.ranks[key].connector._worker.producer is not None


def test_two_prefill_dp_engines_to_two_decode_dp_engines_from_one_extra_config(model_dir, hosts, monkeypatch):
    base = free_port_block(DP * P_TP)
    # One dict for every engine core: every interface, advertised from the host's environment.
    extra = {"side_channel_host": "0.0.0.0", "advertise_host": f"env:{HOST_VAR}", "side_channel_port": base}
    monkeypatch.setenv(HOST_VAR, "127.0.0.1")  # the engine cores' scheduler side (this process)
    for host in (hosts["prefill"], hosts["decode"]):
        host.call("call", "-", _set_env, HOST_VAR, "127.0.0.1")  # the workers
    engines: list[Engine] = []
    try:
        prefills = []
        for dp in range(DP):  # the second core died here in register_kv_caches before the DP offset (EADDRINUSE)
            prefills.append(Engine(f"P{dp}", model_dir, [hosts["prefill"]], tp_size=P_TP, block_size=16,
                                   kv_role="kv_producer", is_prefill=True, extra=extra, engine_id="prefill-ep",
                                   dp_size=DP, dp_rank=dp))
            engines.append(prefills[-1])
        decodes = []
        for dp in range(DP):  # kv_consumer: binds nothing, so the same dict is harmless
            decodes.append(Engine(f"D{dp}", model_dir, [hosts["decode"]], tp_size=1, block_size=32,
                                  kv_role="kv_consumer", is_prefill=False, extra=extra, engine_id="decode-ep",
                                  dp_size=DP, dp_rank=dp))
            engines.append(decodes[-1])
        for dp, p in enumerate(prefills):
            parallel = p.vllm_config.parallel_config
            assert (parallel.data_parallel_index, parallel.data_parallel_rank) == (dp, 0)  # vLLM reset the rank
            assert p.vllm_config.kv_transfer_config.engine_id == f"prefill-ep_dp{dp}"  # vLLM's suffix
            card = p.connector._scheduler.card
            assert card.addresses == tuple(f"tcp://127.0.0.1:{base + dp * P_TP + r}" for r in range(P_TP))
        assert [d.call("call", _is_producer) for d in decodes] == [False, False]  # kv_consumer binds nothing

        # Every pair: prefill on P_i, the params through JSON (the proxy), decode on D_j.
        for (i, j), n in N.items():
            prefills[i].add(f"p{i}-{j}", n, params={kvp.DO_REMOTE_DECODE: True})
        finished: dict[str, object] = {}
        run_until("every prefill", lambda: len(finished) == len(N), prefills,
                  on_step=lambda e, r: finished.update(r.finished))
        for (i, j), n in N.items():
            params = through_json(finished[f"p{i}-{j}"].kv_transfer_params)
            ticket = ticket_from_params(params[kvp.TICKET])
            issuer = prefills[i].vllm_config.kv_transfer_config.engine_id
            assert params["remote_engine_id"] == ticket.engine_id == issuer  # the issuing DP engine names itself
            assert [_port(a) for a in ticket.addresses] == [base + i * P_TP + r for r in range(P_TP)]
            decodes[j].add(f"d{i}-{j}", n, params=params)
        received: set[str] = set()
        run_until("every load", lambda: len(received) == len(N), [*decodes, *prefills],
                  on_step=lambda e, r: received.update(r.finished_recving) if e in decodes else None)
        for j, d in enumerate(decodes):
            layouts = [(d.layout(f"d{i}-{j}", N[i, j] - 1), seed_of(f"p{i}-{j}")) for i in range(DP)]
            d.call("check", layouts, True)  # every group's bytes of both prefill engines' requests
        run_until("every engine empty", lambda: all(e.is_empty() for e in engines), engines)
        assert {(i, j) for i, j in itertools.product(range(DP), repeat=2)} == set(N)
    finally:
        for engine in engines:
            engine.shutdown()
        for host in (hosts["prefill"], hosts["decode"]):
            host.call("call", "-", _set_env, HOST_VAR, None)


def test_a_dp_engine_whose_rank_port_leaves_the_range_stops_at_start(model_dir):
    """The scheduler checks the engine's highest rank port when vLLM builds it, before any worker binds."""
    cfg = make_vllm_config(model_dir, tp_size=2, block_size=16, kv_role="kv_producer",
                           extra={"side_channel_port": 65533}, dp_size=DP, dp_rank=1)
    with pytest.raises(ConfigError) as info:
        make_scheduler(cfg, make_kv_cache_config(cfg, 16))
    assert info.value.field == "side_channel_port" and "data_parallel_index 1" in str(info.value)
    assert "65536" in str(info.value)  # 65533 + 1 x 2 + 1
