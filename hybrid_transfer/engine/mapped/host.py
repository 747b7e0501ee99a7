"""Whether two ranks share a host, and what mappings this process can open.

A host key is a digest of what two processes must share for a mapping to open: the machine and boot
(a restarted host is another host), the user (shared-memory segments are created 0600) and the
shared-memory file system (a container with its own /dev/shm cannot open ours). Equal keys are only a
hint: the consumer still opens the handles, and a handle that does not open leaves the link on NIXL.
"""

from __future__ import annotations

import functools
import hashlib
import os

SHM_DIR = "/dev/shm"


def _read(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


@functools.cache
def host_key() -> str:
    """This process's host key (32 hex characters); "" where no machine identity can be read."""
    machine = _read("/etc/machine-id") or _read("/var/lib/dbus/machine-id")
    boot = _read("/proc/sys/kernel/random/boot_id")
    if not machine and not boot:
        return ""
    try:
        st = os.stat(SHM_DIR)
        shm = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        shm = ""
    text = "|".join((machine, boot, str(os.getuid()), shm))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def can_open(kind: str, *, on_gpu: bool) -> bool:
    """Whether this process can open mappings of ``kind`` into a cache on the GPU (``on_gpu``) or host."""
    if kind == "shm":
        return not on_gpu and os.path.isdir(SHM_DIR)
    if kind == "cuda_ipc":
        if not on_gpu:
            return False
        try:
            import triton  # noqa: F401 - the gather kernel's compiler (cuda_ipc.py)
        except ImportError:
            return False
        return True
    return False
