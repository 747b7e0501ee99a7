"""Which NIXL build is installed and how it loads: the doctor's questions, answered inside engine/.

The engine is the only layer that imports NIXL; the doctor (hybrid_transfer/doctor/host.py) asks
here instead of importing NIXL's modules itself (docs/tuning.md#doctor).
"""

from __future__ import annotations

import ctypes
import glob
import importlib
import os
from types import ModuleType

NIXL_LOG_ENV = "NIXL_LOG_LEVEL"


def quiet_by_default() -> None:
    """Keep NIXL's logger at WARN unless ``$NIXL_LOG_LEVEL`` asks otherwise; call before NIXL's first import.

    NIXL reads the variable once, when its logging is set up on import; without it, it logs a line per agent
    and per backend at INFO on stdout. ``hybrid-transfer --log-level debug`` (or info) sets it to that level.
    """
    os.environ.setdefault(NIXL_LOG_ENV, "WARN")


def import_api(meta_module: str = "nixl") -> ModuleType:
    """NIXL's meta package, then its ``_api`` (the build the meta package picked).

    Raises whatever the import raises (ImportError, or an error of the meta package's CUDA probe).
    """
    quiet_by_default()
    importlib.import_module(meta_module)
    return importlib.import_module(f"{meta_module}._api")


def first_loadable_api(builds: list[str]) -> str | None:
    """The ``_api`` module name of the first installed build (``nixl-cu13`` -> ``nixl_cu13._api``) that imports."""
    quiet_by_default()
    for build in builds:
        name = build.replace("-", "_") + "._api"
        try:
            importlib.import_module(name)
        except Exception:
            continue
        return name
    return None


def cuda_major() -> int | None:
    """The CUDA major version NIXL's meta package detects; None without the meta package's helper."""
    try:
        from nixl_meta_utils import detect_cuda_major
    except ImportError:
        return None
    return detect_cuda_major()


def ucx_version(api_module: str) -> str | None:
    """Version of the UCX library bundled next to the NIXL build (``<build>.libs/libucp-*.so*``)."""
    module = importlib.import_module(api_module)
    libs = os.path.dirname(module.__file__) + ".libs"
    for path in sorted(glob.glob(os.path.join(libs, "libucp*.so*"))):
        try:
            fn = ctypes.CDLL(path).ucp_get_version_string
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_char_p
        return fn().decode()
    return None
