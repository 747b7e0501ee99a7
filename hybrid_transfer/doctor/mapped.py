"""The doctor's check of the mapped read path (issue 28): can this host map a producer's cache, and does it?

A consumer reads a producer over a mapping instead of NIXL only when both ranks share a host, it can
open the producer's kind of handle and a shared secret authenticated the handshake
(docs/tuning.md#mapped-reads). This check names what this process can open (shared memory for caches
the library allocates on a CPU host; CUDA IPC, which also needs Triton, for GPU caches), whether a
secret is set, and moves real bytes once: a shared-memory segment created here, mapped read-only, its
ranges copied by the mapped path's host copy and compared.
"""

from __future__ import annotations

import numpy as np

from hybrid_transfer.doctor.types import CheckResult, Status
from hybrid_transfer.engine import auth, wire
from hybrid_transfer.engine.mapped import host_copy, shm
from hybrid_transfer.engine.mapped.host import can_open, host_key
from hybrid_transfer.errors import HybridTransferError

NAME = "mapped_path"


def check_mapped_path(*, gpu_present: bool, secret_file: str | None = None) -> CheckResult:
    kinds = [k for k in wire.MAP_KINDS if can_open(k, on_gpu=False) or (gpu_present and can_open(k, on_gpu=True))]
    key = host_key()
    try:
        secret = auth.load_secret(secret_file)
    except HybridTransferError as exc:
        return CheckResult(NAME, Status.WARN, f"the shared secret cannot be read: {exc}",
                           fix="fix the secret (docs/security.md): without one every link reads over NIXL")
    data = {"kinds": kinds, "host_key": bool(key), "secret": secret is not None,
            "copy": "readv" if host_copy._READV is not None else "rows"}
    moved = _round_trip() if "shm" in kinds else "not tried (no shared-memory file system)"
    data["round_trip"] = moved
    if not key or not kinds:
        return CheckResult(NAME, Status.WARN, f"this host cannot map a producer's cache (kinds: {kinds or 'none'}, "
                           f"host identity: {'yes' if key else 'none'}): every link reads over NIXL", data=data,
                           fix="nothing to do unless a mapped path is expected here; it needs /etc/machine-id or a "
                               "boot id, /dev/shm for host caches, Triton for GPU caches")
    if moved != "ok":
        return CheckResult(NAME, Status.WARN, f"a shared-memory round trip failed: {moved}", data=data,
                           fix="check /dev/shm (mounted, writable, not full): links read over NIXL meanwhile")
    if secret is None:
        return CheckResult(NAME, Status.WARN, f"this host can map ({', '.join(kinds)}; host copy: {data['copy']}), "
                           "but no shared secret is set: producers offer no handles and every link reads over NIXL",
                           data=data, fix=f"set the same secret on every engine (${auth.SECRET_ENV} or "
                                          "EngineConfig.secret_file, docs/security.md#mapped-reads)")
    return CheckResult(NAME, Status.PASS, f"mapped reads possible here: {', '.join(kinds)} (host copy: "
                       f"{data['copy']}; a shared-memory round trip moved its bytes exactly); the choice is made per "
                       "link at the handshake (Consumer.link_transports, metrics 'transports')", data=data)


def _round_trip() -> str:
    """Create a segment, map it read-only, copy two ranges out with the mapped path's copy; "ok" or the error."""
    try:
        segments = shm.SharedSegments(1 << 16, 1)
    except HybridTransferError as exc:
        return str(exc)
    try:
        src = np.frombuffer(segments.buffers[0], np.uint8)
        src[:] = np.arange(src.shape[0], dtype=np.uint64).astype(np.uint8)
        opened = shm.ReadOnlyMapping(segments.names[0], 1 << 16)
        try:
            dst = np.zeros(8192, np.uint8)
            host_copy.copy_ranges(dst.ctypes.data + np.asarray([0, 4096]), opened.addr + np.asarray([40960, 8]),
                                  np.asarray([4096, 4096]))
            ok = np.array_equal(dst[:4096], src[40960:45056]) and np.array_equal(dst[4096:], src[8:4104])
        finally:
            del src
            opened.close()
        return "ok" if ok else "the bytes copied differ from the segment's"
    except HybridTransferError as exc:
        return str(exc)
    finally:
        segments.close()
