"""``doctor --serve`` and ``doctor --peer``: bandwidth, latency and UCX's transports between two hosts.

The server binds an explicit host, registers one filled DRAM buffer with the engine's NIXL agent and
serves exactly one peer that passes the exchange (link_wire), or gives up at its deadline. The peer
READs that buffer through its own agent: one warm-up READ (connection set-up and protocol selection
included), ``repeats`` timed whole-buffer READs (GB/s, the last one verified word by word) and
``latency_repeats`` 8-byte READs (microseconds). UCX prints the protocols it picked into the peer's
log (``UCX_PROTO_INFO=y``, set before the agent exists), and the peer names their transports. ucx-py
(ucxx) is not used: its Python API has no one-sided READ (docs/between-hosts.md#ucx-py).
"""

from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from hybrid_transfer.doctor import link_wire as w
from hybrid_transfer.doctor.loopback import Memory, PatternBuffer, timed_read
from hybrid_transfer.doctor.types import CheckResult, DoctorReport, Status
from hybrid_transfer.doctor.ucx_tables import parse_proto_tables, read_tables
from hybrid_transfer.engine.tcp_path import environment
from hybrid_transfer.errors import ConfigError, HybridTransferError

log = logging.getLogger(__name__)

LATENCY_BYTES = 8
MAX_LINK_BYTES = 4 << 30  # the buffer each side pins; a peer refuses a server that asks for more
STEP_TIMEOUT_S = 30.0  # one exchange step; the whole serve is bounded by LinkOptions.timeout_s
MAX_REFUSALS = 64  # refused connections logged one by one; past this, counted only
SECRET_FIX = ("give both hosts the same secret: export HYBRID_TRANSFER_SECRET=... (16+ bytes, e.g. "
              "$(openssl rand -hex 32)) or pass --secret-file PATH on both sides")


class LinkOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What ``--serve`` / ``--peer`` need; ``secret`` comes from engine.auth.load_secret, never from a flag."""

    host: str = ""  # --serve: the host to bind (explicit); --peer: the server's host
    port: int = w.DEFAULT_LINK_PORT
    timeout_s: float = 60.0  # --serve: give up when no peer finished by then; --peer: the whole exchange
    num_bytes: int = 64 << 20  # --serve: the buffer a peer READs
    repeats: int = 5
    latency_repeats: int = 50
    api_module: str | None = None  # NIXL module, e.g. "nixl_cu13._api"; None: resolved when an agent is made
    secret: bytes | None = None

    def validate(self) -> LinkOptions:
        if not self.host:
            raise ConfigError("--serve needs an explicit --host to bind (an address of the interface the other host "
                              "reaches, or 0.0.0.0 for every interface)", field="host", value=self.host)
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port={self.port} must be in [0, 65535]", field="port", value=self.port)
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout={self.timeout_s} must be above 0 seconds", field="timeout", value=self.timeout_s)
        if not LATENCY_BYTES <= self.num_bytes <= MAX_LINK_BYTES or self.num_bytes % 8:
            raise ConfigError(f"num_bytes={self.num_bytes} must be a multiple of 8 in [{LATENCY_BYTES}, "
                              f"{MAX_LINK_BYTES}]", field="num_bytes", value=self.num_bytes)
        if self.repeats < 1 or self.latency_repeats < 1:
            raise ConfigError(f"repeats={self.repeats}, latency_repeats={self.latency_repeats} must be at least 1",
                              field="repeats", value=self.repeats)
        return self


def _agent(name: str, api_module: str | None):
    """The engine's agent (NIXL is imported here, not before: a refused peer never loads it).

    Raises:
        EngineError: NIXL does not import (the nixl check's detail), or the agent cannot be made.
    """
    from hybrid_transfer.doctor.host import check_nixl_import
    from hybrid_transfer.engine.agent import NixlAgent, quiet_nixl_logging
    from hybrid_transfer.engine.config import EngineConfig
    from hybrid_transfer.errors import EngineError

    if api_module is None:
        nixl = check_nixl_import()
        if nixl.status is not Status.PASS:
            raise EngineError(f"{nixl.detail}; fix: {nixl.fix}", operation="import nixl", agent=name)
        api_module = nixl.data["api_module"]
    quiet_nixl_logging(api_module=api_module)
    return NixlAgent(name, EngineConfig(), api_module=api_module)


# ---- the server ---------------------------------------------------------------------------------------------


def serve(options: LinkOptions, on_listen: Callable[[str, int], None] | None = None) -> DoctorReport:
    """Serve one peer on ``options.host``:``options.port`` until it finished or ``timeout_s`` passed."""
    options.validate()
    deadline = time.monotonic() + options.timeout_s
    name = f"ht-doctor-serve-{secrets.token_hex(3)}"
    family = socket.AF_INET6 if ":" in options.host else socket.AF_INET
    listener = socket.create_server((options.host.strip("[]"), options.port), family=family)
    agent = None
    refused = 0
    try:
        host, port = listener.getsockname()[:2]
        agent = _agent(name, options.api_module)
        buf = PatternBuffer(Memory.DRAM, options.num_bytes, 0, fill=True)
        agent.register([buf])
        if on_listen is not None:
            on_listen(host, port)
        while time.monotonic() < deadline:
            listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                conn, where = listener.accept()
            except TimeoutError:
                break
            with conn:
                try:
                    finished = _serve_one(conn, agent, buf, options, deadline, name)
                except (HybridTransferError, OSError) as exc:
                    refused += 1
                    (log.warning if refused <= MAX_REFUSALS else log.debug)("doctor --serve: %s:%s: %s",
                                                                            *where[:2], exc)
                    continue
            return DoctorReport(checks=(_served(finished, where, options, refused),))
        return DoctorReport(checks=(CheckResult(
            name="serve", status=Status.FAIL,
            detail=f"no peer finished within {options.timeout_s:g} s on {host}:{port} ({refused} refused)",
            fix="run `hybrid-transfer doctor --peer HOST:PORT` on the other host within --timeout; open the port "
                "in the firewall; give both the same secret", data={"refused": refused}),))
    finally:
        listener.close()
        if agent is not None:
            agent.close()


def _serve_one(conn: socket.socket, agent, buf: PatternBuffer, options: LinkOptions, deadline: float,
               name: str) -> w.Finished:
    step = min(deadline, time.monotonic() + STEP_TIMEOUT_S)
    sn = w.new_nonce()
    w.send(conn, w.Hello(version=w.LINK_VERSION, server_agent=name, sn=sn, secret_required=options.secret is not None,
                         num_bytes=options.num_bytes))
    join = w.recv(conn, step, "the peer's Join", name)
    if not isinstance(join, w.Join) or join.version != w.LINK_VERSION:
        w.send(conn, w.Refused(f"expected Join version {w.LINK_VERSION}"))
        raise ConfigError(f"not a Join of version {w.LINK_VERSION}: {type(join).__name__}", field="peer",
                          value=type(join).__name__)
    if options.secret is not None and not w.proven(options.secret, w.PEER_ROLE, join.proof, join.cn, sn, name,
                                                   join.peer_agent):
        why = "this server requires the shared secret" if not join.proof else "the secret does not match"
        w.send(conn, w.Refused(why))
        raise ConfigError(f"refused peer {join.peer_agent!r}: {why}", field="secret", value=join.peer_agent)
    w.send(conn, w.Offer(metadata=agent.metadata, addr=buf.addr, num_bytes=options.num_bytes,
                         proof=w.prove(options.secret, w.SERVE_ROLE, join.cn, sn, name, join.peer_agent)))
    # Progress UCX on this side while the peer READs: TCP has no one-sided READ, so every byte needs it.
    fd = conn.fileno()
    while time.monotonic() < deadline:
        agent.get_notifs()
        if select.select([fd], [], [], 0)[0]:
            break
    done = w.recv(conn, deadline, "the peer's Finished", name)
    if not isinstance(done, w.Finished):
        raise ConfigError(f"expected Finished, got {type(done).__name__}", field="peer", value=type(done).__name__)
    return done


def _served(done: w.Finished, where, options: LinkOptions, refused: int) -> CheckResult:
    data = {"peer": f"{where[0]}:{where[1]}", "refused": refused, **msgspec.to_builtins(done)}
    if done.verified:
        return CheckResult(name="serve", status=Status.PASS, data=data,
                           detail=f"served {where[0]}: it read {options.num_bytes} B at {done.gbps:.3f} GB/s, "
                                  f"8 B in {done.latency_us:.1f} us, bytes verified ({refused} refused before)")
    return CheckResult(name="serve", status=Status.FAIL, data=data,
                       detail=f"the peer at {where[0]} finished without verified bytes: {done.error}",
                       fix="see the peer's report")


# ---- the peer -----------------------------------------------------------------------------------------------


def peer(options: LinkOptions) -> DoctorReport:
    """Connect to a ``--serve`` at ``options.host``:``options.port``, READ its buffer, name UCX's transports."""
    if not options.host:
        raise ConfigError("--peer needs HOST:PORT", field="peer", value=options.host)
    with tempfile.TemporaryDirectory(prefix="ht-doctor-peer-") as log_dir:
        # UCX reads these once, when this process creates its first UCX context (the agent below); they are
        # restored after, so nothing later in this process logs into a folder that is gone.
        env = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": os.path.join(log_dir, "ucx-peer.%p.log")}
        with environment(env):
            checks = _peer_checks(options)
            _flush_c_streams()  # UCX writes its log through a buffered C stream, flushed at exit otherwise
        ucx_log = "".join(p.read_text(errors="replace") for p in sorted(Path(log_dir).glob("*.log")))
    link, *measured = checks
    if measured:
        measured.append(_transports(ucx_log, link.data["peer_agent"], link.data["num_bytes"]))
    return DoctorReport(checks=(link, *measured))


def _flush_c_streams() -> None:
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)  # fflush(NULL): every open output stream of this process
    except (OSError, AttributeError) as exc:  # no C library handle here: the tables show up at exit only
        log.debug("fflush(NULL) failed: %s", exc)


def _peer_checks(options: LinkOptions) -> list[CheckResult]:
    deadline = time.monotonic() + options.timeout_s
    name = f"ht-doctor-peer-{secrets.token_hex(3)}"
    where = f"{options.host}:{options.port}"
    try:
        sock = socket.create_connection((options.host, options.port), timeout=min(options.timeout_s, STEP_TIMEOUT_S))
    except OSError as exc:
        return [CheckResult(name="peer_link", status=Status.FAIL, detail=f"cannot connect to {where}: {exc}",
                            fix="start `hybrid-transfer doctor --serve --host HOST --port PORT` there first; open the "
                                "port in the firewall between the hosts")]
    agent = None
    with sock:
        try:
            hello = w.recv(sock, deadline, "the server's Hello", name)
            if not isinstance(hello, w.Hello) or hello.version != w.LINK_VERSION:
                raise ConfigError(f"{where} is not a doctor --serve of link version {w.LINK_VERSION}", field="peer",
                                  value=where)
            msgspec.structs.replace(options, num_bytes=hello.num_bytes).validate()  # a hostile size pins nothing
            cn = w.new_nonce()
            w.send(sock, w.Join(version=w.LINK_VERSION, peer_agent=name, cn=cn,
                                proof=w.prove(options.secret, w.PEER_ROLE, cn, hello.sn, hello.server_agent, name)))
            offer = w.recv(sock, deadline, "the server's Offer", name)
            if isinstance(offer, w.Refused):
                return [CheckResult(name="peer_link", status=Status.FAIL, fix=SECRET_FIX,
                                    detail=f"{where} refused this peer: {offer.reason}",
                                    data={"refused": offer.reason})]
            if not isinstance(offer, w.Offer):
                raise ConfigError(f"{where} sent {type(offer).__name__}, not an Offer", field="peer", value=where)
            if options.secret is not None and not w.proven(options.secret, w.SERVE_ROLE, offer.proof, cn, hello.sn,
                                                           hello.server_agent, name):
                return [CheckResult(name="peer_link", status=Status.FAIL, fix=SECRET_FIX,
                                    detail=f"{where} did not prove the shared secret (it holds "
                                           f"{'another' if offer.proof else 'none'})")]
            agent = _agent(name, options.api_module)  # only now: a refused peer pins nothing
            buf = PatternBuffer(Memory.DRAM, hello.num_bytes, 0, fill=False)
            agent.register([buf])
            link = CheckResult(name="peer_link", status=Status.PASS,
                               detail=f"{where}: agent {hello.server_agent}, "
                                      f"secret {'proven both ways' if options.secret is not None else 'none'}",
                               data={"server_agent": hello.server_agent, "peer_agent": name,
                                     "num_bytes": hello.num_bytes, "secret": options.secret is not None})
            finished, checks = _measure(agent, buf, offer, options, deadline)
            w.send(sock, finished)
            return [link, *checks]
        except HybridTransferError as exc:
            return [CheckResult(name="peer_link", status=Status.FAIL, detail=f"{where}: {exc}",
                                fix="check that the server still runs (its --timeout) and that both sides have the "
                                    "same hybrid_transfer version")]
        finally:
            if agent is not None:
                agent.close()


def _measure(agent, buf: PatternBuffer, offer: w.Offer, options: LinkOptions,
             deadline: float) -> tuple[w.Finished, list[CheckResult]]:
    peer_name = agent.add_remote(offer.metadata)
    remote = np.array([[offer.addr, offer.num_bytes, 0]], dtype=np.int64)
    first_s = timed_read(agent, peer_name, buf.descs(), remote, deadline)
    if not buf.holds_pattern():
        error = "the warm-up READ completed but the bytes differ from the server's"
        return w.Finished(verified=False, error=error), [CheckResult(name="peer_bandwidth", status=Status.FAIL,
                                                                      detail=error, fix="report this as a bug")]
    samples = []
    for i in range(options.repeats):
        if i == options.repeats - 1:
            buf.clear()  # the last READ must prove itself too
        samples.append(offer.num_bytes / timed_read(agent, peer_name, buf.descs(), remote, deadline) / 1e9)
    verified = buf.holds_pattern()
    small_local = np.array([[buf.addr, LATENCY_BYTES, 0]], dtype=np.int64)
    small_remote = np.array([[offer.addr, LATENCY_BYTES, 0]], dtype=np.int64)
    latencies = [timed_read(agent, peer_name, small_local, small_remote, deadline) * 1e6
                 for _ in range(options.latency_repeats)]
    gbps, latency_us = statistics.median(samples), statistics.median(latencies)
    bandwidth = CheckResult(
        name="peer_bandwidth", status=Status.PASS if verified else Status.FAIL,
        detail=(f"{offer.num_bytes} B READ: {gbps:.3f} GB/s (median of {len(samples)}; first READ with set-up "
                f"{first_s * 1e3:.1f} ms), bytes {'verified' if verified else 'DIFFER'}"),
        fix="" if verified else "report this as a bug",
        data={"gbps": gbps, "gbps_samples": samples, "first_read_s": first_s, "verified": verified})
    latency = CheckResult(name="peer_latency", status=Status.PASS,
                          detail=f"{LATENCY_BYTES} B READ: {latency_us:.1f} us (median of {len(latencies)}, "
                                 f"min {min(latencies):.1f} us)",
                          data={"latency_us": latency_us, "latency_min_us": min(latencies)})
    return w.Finished(verified=verified, gbps=gbps, latency_us=latency_us), [bandwidth, latency]


def _transports(ucx_log: str, peer_agent: str, num_bytes: int) -> CheckResult:
    tables = read_tables(parse_proto_tables(ucx_log.splitlines()), peer_agent, "host")
    if not tables:
        return CheckResult(name="peer_transports", status=Status.WARN,
                           detail="UCX printed no READ protocol table (UCX_PROTO_INFO): transports unknown",
                           fix="run doctor --peer in a fresh process, not after something else loaded UCX")
    lanes = {size: sorted({row.config for t in tables for row in t.rows if row.covers(size)})
             for size in (num_bytes, LATENCY_BYTES)}
    transports = sorted({tr for t in tables for row in t.rows for tr in row.transports})
    scopes = sorted({t.scope for t in tables})
    return CheckResult(name="peer_transports", status=Status.PASS,
                       detail=f"UCX READs ({', '.join(scopes)}): {num_bytes} B over {'; '.join(lanes[num_bytes])}, "
                              f"{LATENCY_BYTES} B over {'; '.join(lanes[LATENCY_BYTES])}",
                       data={"transports": transports, "scopes": scopes,
                             "lanes": {str(k): v for k, v in lanes.items()}})
