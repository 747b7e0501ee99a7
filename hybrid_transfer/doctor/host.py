"""Doctor checks of the host itself: NIXL import and build, UCX backend, side-channel port, progress thread."""

from __future__ import annotations

import errno
import importlib
import importlib.metadata
import logging
import os
import socket
import time
from typing import Any

from hybrid_transfer.doctor.types import CheckResult, Status
from hybrid_transfer.engine import nixl_install
from hybrid_transfer.engine.agent import NixlAgent, quiet_nixl_logging
from hybrid_transfer.engine.config import EngineConfig, ProgressPolicy
from hybrid_transfer.errors import EngineError, HybridTransferError

log = logging.getLogger(__name__)

_BUILDS = ("nixl-cu12", "nixl-cu13", "nixl-rocm")
BUSY_SPIN_CORE_FRACTION = 0.5  # a thread using at least half a core while the agent is idle is spinning
FEW_CORES = 8  # at or below this, one spinning core is a large share of the host


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_nixl_import(meta_module: str = "nixl") -> CheckResult:
    """1. ``import nixl`` (the meta package picks nixl-cu12 / nixl-cu13 from torch's CUDA); which build it chose."""
    installed = {d: v for d in _BUILDS if (v := _dist_version(d)) is not None}
    data: dict[str, Any] = {"meta_version": _dist_version(meta_module), "installed_builds": installed}
    try:
        api = nixl_install.import_api(meta_module)
    except Exception as exc:  # ImportError, or whatever the meta package's CUDA probe raised
        data["error"] = f"{type(exc).__name__}: {exc}"
        fallback = nixl_install.first_loadable_api(list(installed))
        if fallback is not None:
            data["api_module"] = fallback  # the remaining checks can still diagnose the build itself
        wanted = str(exc).split(" but ")[-1] if "is not installed" in str(exc) else ""
        fix = (f"pip install {wanted.split()[0]}" if wanted else
               "pip install nixl  (the meta package; it installs nixl-cu12 and nixl-cu13 and picks one at import)")
        return CheckResult(name="nixl", status=Status.FAIL,
                           detail=f"import {meta_module} failed: {data['error']}", fix=fix, data=data)
    quiet_nixl_logging(api_module=api.__name__)
    package = api.__name__.rsplit(".", 1)[0]  # "nixl_cu13" behind the meta package's alias
    build = package.replace("_", "-")
    data.update(api_module=api.__name__, build=build, build_version=_dist_version(build),
                module_path=os.path.dirname(api.__file__), cuda_major=nixl_install.cuda_major())
    detail = (f"nixl {data['meta_version']} -> {build} {data['build_version']} ({data['module_path']}); "
              f"CUDA seen by nixl: {data['cuda_major'] or 'none'}")
    return CheckResult(name="nixl", status=Status.PASS, detail=detail, data=data)


def check_ucx_backend(api_module: str) -> CheckResult:
    """2. The engine's agent (UCX backend, the engine's default settings) can be created; which plugins NIXL found."""
    quiet_nixl_logging(api_module=api_module)
    data: dict[str, Any] = {"plugin_dir_env": os.environ.get("NIXL_PLUGIN_DIR")}
    try:
        agent = NixlAgent("ht-doctor-probe", EngineConfig(), api_module=api_module)
    except EngineError as exc:  # the agent names the plugins it found when UCX did not come up
        data["error"] = str(exc)
        fix = ("reinstall the nixl wheel (its libplugin_UCX.so is missing) or unset a NIXL_PLUGIN_DIR that points "
               "elsewhere" if "no UCX plugin" in str(exc) else
               "NIXL's log above says why; check UCX_TLS (it must leave an active-message transport such as tcp) "
               "and rerun with UCX_LOG_LEVEL=info")
        return CheckResult(name="ucx_backend", status=Status.FAIL,
                           detail=f"creating an agent with UCX failed: {data['error']}", fix=fix, data=data)
    try:
        data["plugins"], data["backends"], data["mem_types"] = agent.plugins, agent.backends, agent.mem_types("UCX")
    except EngineError as exc:
        data["error"] = str(exc)
        return CheckResult(name="ucx_backend", status=Status.FAIL, detail=f"querying the UCX backend failed: {exc}",
                           fix="rerun with UCX_LOG_LEVEL=info and read NIXL's errors", data=data)
    finally:
        agent.close()
        del agent  # NIXL tears the agent down with its last reference
    try:
        data["ucx_version"] = nixl_install.ucx_version(api_module)
    except (OSError, AttributeError, ImportError) as exc:  # informational only
        log.debug("reading UCX's version failed: %s", exc)
    detail = (f"UCX {data.get('ucx_version') or '?'} backend up, memory {', '.join(data.get('mem_types', []))}; "
              f"plugins: {', '.join(data['plugins'])}")
    return CheckResult(name="ucx_backend", status=Status.PASS, detail=detail, data=data)


def engine_side_channel_defaults() -> tuple[str, int]:
    """(host, port) the engine's producer binds by default."""
    config = EngineConfig()
    return config.side_channel_host, config.side_channel_port


def check_side_channel_port(host: str | None = None, port: int | None = None) -> CheckResult:
    """6. The side-channel (ZeroMQ) port can be bound on the configured host; None: the engine's default."""
    default_host, default_port = engine_side_channel_defaults()
    host = default_host if host is None else host
    port = default_port if port is None else port
    data: dict[str, Any] = {"host": host, "port": port}
    bind_host = None if host in ("*", "0.0.0.0", "") else host.strip("[]")  # ZeroMQ's "*": every interface
    try:
        infos = socket.getaddrinfo(bind_host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return CheckResult(name="side_channel_port", status=Status.FAIL, detail=f"host {host!r} does not resolve: {exc}",
                           fix="set EngineConfig.side_channel_host to an address of this host", data=data)
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # ZeroMQ sets SO_REUSEADDR too: a port left in TIME_WAIT is free for it, one with a listener is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1)
        data["bound_port"] = sock.getsockname()[1]
    except OSError as exc:
        data["error"] = f"{errno.errorcode.get(exc.errno, exc.errno)}: {exc.strerror}"
        if exc.errno == errno.EADDRINUSE:
            fix = (f"another process listens on {port} (`ss -ltnp 'sport = :{port}'` names it): stop it, or pick "
                   f"another port (EngineConfig.side_channel_port; 0 lets the engine pick a free one)")
        elif exc.errno == errno.EACCES:
            fix = "ports below 1024 need privileges: use a port of 1024 or above (or 0)"
        else:
            fix = "set EngineConfig.side_channel_host to an address of this host"
        return CheckResult(name="side_channel_port", status=Status.FAIL,
                           detail=f"cannot bind {host}:{port}: {data['error']}", fix=fix, data=data)
    finally:
        sock.close()
    if port == 0:
        detail = (f"port 0 (the engine's default): the producer binds a free port on {host} at start and "
                  f"publishes it; a bind here got port {data['bound_port']}")
    else:
        detail = f"{host}:{port} is free"
    return CheckResult(name="side_channel_port", status=Status.PASS, detail=detail, data=data)


def measure_idle_cpu(sample_s: float) -> float:
    """This process's CPU time over ``sample_s`` seconds of sleep, in cores (1.0: one core busy)."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    time.sleep(sample_s)
    return (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def check_progress_thread(api_module: str, sample_s: float = 0.5, num_cores: int | None = None) -> CheckResult:
    """7. CPU used by NIXL's progress thread (its Python wrapper's default poll delay, 0) on an idle agent."""
    quiet_nixl_logging(api_module=api_module)
    baseline = measure_idle_cpu(min(0.2, sample_s))
    # NIXL's own default: a progress thread that never sleeps between rounds.
    nixl_default = EngineConfig(progress=ProgressPolicy.ON_WITH_DELAY, progress_delay_us=0)
    agent = NixlAgent("ht-doctor-progress", nixl_default, api_module=api_module)
    try:
        spin = max(0.0, measure_idle_cpu(sample_s) - baseline)
    finally:
        agent.close()
        del agent  # the thread stops when NIXL tears the agent down
    engine = _engine_policy_cpu(api_module, sample_s, baseline)
    return judge_progress_thread(spin, usable_cores() if num_cores is None else num_cores, engine)


def _engine_policy_cpu(api_module: str, sample_s: float, baseline: float) -> dict[str, Any]:
    """The engine's default progress policy, measured the same way."""
    config = EngineConfig()
    try:
        agent = NixlAgent("ht-doctor-engine-policy", config, api_module=api_module)
    except HybridTransferError as exc:  # the NIXL figure is the check; this one only compares
        return {"error": f"{type(exc).__name__}: {exc}"}
    try:
        cores = max(0.0, measure_idle_cpu(sample_s) - baseline)
    finally:
        agent.close()
        del agent
    return {"policy": config.progress.value, "progress_delay_us": config.progress_delay_us, "cores": round(cores, 3)}


def judge_progress_thread(spin_cores: float, num_cores: int, engine: dict[str, Any] | None = None) -> CheckResult:
    """Verdict on a measured progress-thread load: warn when it spins a core on a host with few cores."""
    engine = engine or {}
    data = {"nixl_default_cores": round(spin_cores, 3), "usable_cores": num_cores, "engine_policy": engine}
    spins = spin_cores >= BUSY_SPIN_CORE_FRACTION
    ours = ""
    if "cores" in engine:
        how = ("thread off, poll() progresses NIXL" if engine["policy"] == "off"
               else f"thread on, {engine['progress_delay_us']} us delay")
        ours = f"; the engine's default ({how}) uses {engine['cores']:.2f}"
    detail = f"NIXL's default progress thread uses {spin_cores:.2f} of a core while idle{ours}"
    if spins and num_cores <= FEW_CORES:
        policy = (f"EngineConfig(progress={engine['policy']!r}, progress_delay_us={engine['progress_delay_us']})"
                  if "cores" in engine else "EngineConfig's default progress policy")
        return CheckResult(
            name="progress_thread", status=Status.WARN,
            detail=f"{detail}: it busy-spins, a large share of this {num_cores}-core host",
            fix=f"keep the engine's default {policy}; agents created with nixl_agent_config(enable_prog_thread="
                "True) directly spin a core each (on 2 cores that halves transfer throughput)", data=data)
    if spins:
        detail += f" (busy-spins; tolerable with {num_cores} cores, but each agent costs one)"
    return CheckResult(name="progress_thread", status=Status.PASS, detail=detail, data=data)
