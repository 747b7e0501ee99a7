"""What the engine workers' fork server loads once (harness.worker_context), before any worker forks.

Every worker needs torch, NIXL's bindings, ZeroMQ and the engine, and its first NIXL agent loads NIXL's
UCX plugin, whose libraries' start-up (UCX's memory hooks patch every library already loaded, torch's
included) costs ~0.4 s of CPU on an idle core. Loaded here once, a worker forked from the server starts
with all of it in place: its first agent takes ~0.02 s instead of ~1.5 s for imports and plugin.

Nothing here starts a thread, opens a socket, creates a NIXL agent or touches CUDA: loading the plugin
runs its libraries' constructors only (UCX reads its transports and devices when an agent is created, in
the worker). What UCX reads at load (its log file, memory-hook mode) comes from the environment the
server started with, so a cluster that needs its own UCX settings per process spawns its workers
(test_tcp_transport). NIXL reads its log level on import, so it is imported the way the engine imports
it (quiet unless ``NIXL_LOG_LEVEL`` asks otherwise).
"""

from __future__ import annotations

import ctypes
import logging
import sys
from pathlib import Path

import numpy  # noqa: F401
import torch  # noqa: F401
import zmq  # noqa: F401

import hybrid_transfer.cache  # noqa: F401
import hybrid_transfer.engine.consumer  # noqa: F401
import hybrid_transfer.engine.producer  # noqa: F401
import hybrid_transfer.verify  # noqa: F401
from hybrid_transfer.engine.nixl_install import import_api

log = logging.getLogger(__name__)


def ucx_plugin(api_module: str) -> Path:
    """Where the NIXL build behind ``api_module`` (``nixl_cu13._api``) keeps its UCX plugin (its wheel's layout)."""
    package = api_module.split(".")[0]
    root = Path(sys.modules[package].__file__).resolve().parent.parent
    return root / f".{package}.mesonpy.libs" / "plugins" / "libplugin_UCX.so"


def load_ucx_plugin() -> bool:
    """dlopen NIXL's UCX plugin (NIXL's own later dlopen of the same file finds it loaded); False if absent."""
    plugin = ucx_plugin(import_api().__name__)
    if not plugin.is_file():
        log.debug("no UCX plugin at %s: each worker loads it on its own", plugin)
        return False
    try:
        ctypes.CDLL(str(plugin))
    except OSError as exc:  # the server must start anyway (its workers then load the plugin themselves)
        log.debug("could not preload %s: %s", plugin, exc)
        return False
    return True


load_ucx_plugin()
