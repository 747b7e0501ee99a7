"""Shared-memory caches: tensors over named POSIX shared memory, and read-only mappings of them.

Only caches this library allocates (``HybridCache.allocate(shared=True)``: the bench, the soak, an
embedder's own) live here; vLLM's CPU caches are plain allocations and stay on NIXL. A segment's name is
``ht-<pid>-<32 hex>``: 128 random bits, created 0600, so only this user can open it and only who was told
the name finds it. The name is a handle: it goes out only inside an authenticated handshake
(docs/security.md#mapped-reads). A consumer maps a segment read-only: it can never write a producer's cache.

Lifetime: the segment's name is removed when the cache's ``SharedSegments`` is closed or collected, or
at interpreter exit; mappings already open stay valid until closed. A producer killed with SIGKILL
leaves its segments behind in /dev/shm. While a segment's name exists its creator holds a shared
``flock`` on it (the kernel drops the lock when the process dies, in whatever PID namespace it ran), and
``sweep_orphans`` removes only segments whose creator's pid is gone here and whose lock nobody holds. A
process's first allocation sweeps, so a crashed run's segments do not outlive the next one
(docs/security.md#mapped-reads).
"""

from __future__ import annotations

import atexit
import fcntl
import logging
import mmap
import os
import re
import secrets
import weakref

import numpy as np

from hybrid_transfer.engine.mapped.host import SHM_DIR
from hybrid_transfer.errors import ConfigError, MappingError

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^ht-(\d{1,10})-[0-9a-f]{32}$")


def _path(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise MappingError(f"{name!r} is not a shared-memory segment name of ours")
    return os.path.join(SHM_DIR, name)


class SharedSegments:
    """The named segments under one cache's tensors; ``close`` removes the names (idempotent)."""

    def __init__(self, nbytes: int, count: int):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"nbytes={nbytes!r} must be a positive integer", field="nbytes", value=nbytes)
        _sweep_once()
        self.names: list[str] = []
        self._maps: list[mmap.mmap] = []
        fds: list[int] = []  # held open while the names exist: each carries the creator's shared flock
        try:
            for _ in range(count):
                name = f"ht-{os.getpid()}-{secrets.token_hex(16)}"
                fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
                fds.append(fd)
                self.names.append(name)
                fcntl.flock(fd, fcntl.LOCK_SH)
                os.ftruncate(fd, nbytes)
                self._maps.append(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE))
        except OSError as exc:
            _release(list(self.names), fds)
            raise MappingError(f"cannot create shared memory in {SHM_DIR}: {exc}", operation="allocate") from exc
        self._finalizer = weakref.finalize(self, _release, list(self.names), fds)
        atexit.register(self._finalizer)

    @property
    def buffers(self) -> list[mmap.mmap]:
        return list(self._maps)

    def close(self) -> None:
        """Remove the segments' names (the tensors stay usable; no new mapping of them can open)."""
        self._finalizer()


def _release(names: list[str], fds: list[int]) -> None:
    """Remove the names, then drop the creator's locks (in that order: a sweeper never sees a lockless name of a
    live cache)."""
    _unlink(names)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def _unlink(names: list[str]) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("cannot remove shared memory %s: %s", name, exc)


class ReadOnlyMapping:
    """One producer segment mapped read-only into this process; ``addr`` is its first byte here."""

    def __init__(self, name: str, length: int):
        path = _path(name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise MappingError(f"cannot open shared memory {name}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < length:
                raise MappingError(f"shared memory {name} holds {size} bytes, the offer says {length}",
                                  operation="open mapping")
            # Page tables filled now, once per link: else every first touch of a page faults inside a READ.
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(fd, length, flags, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._view = np.frombuffer(self._map, dtype=np.uint8)
        self.addr = int(self._view.__array_interface__["data"][0])
        self.length = length

    def close(self) -> None:
        """Unmap (idempotent); nothing may copy from ``addr`` afterwards."""
        if self._view is None:
            return
        self._view = None
        self._map.close()


def sweep_orphans() -> list[str]:
    """Remove segments of ours whose creating process is gone (a producer killed with SIGKILL); their names."""
    removed = []
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for entry in entries:
        m = NAME_RE.match(entry)
        if m is None:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue  # alive (or not ours to signal): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        if _held(entry):
            continue  # its creator lives on (another PID namespace sharing this /dev/shm, say)
        _unlink([entry])
        removed.append(entry)
    return removed


def _held(name: str) -> bool:
    """Whether some process holds the segment's flock (its creator, while the cache lives); True when unsure."""
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # drops the probe's lock, if it got one
    return False


_SWEPT = [False]  # this process has swept (its first allocation does)


def _sweep_once() -> None:
    if _SWEPT[0]:
        return
    _SWEPT[0] = True
    removed = sweep_orphans()
    if removed:
        log.warning("removed %d shared-memory segments of dead processes from %s (a crashed run's caches)",
                    len(removed), SHM_DIR)
