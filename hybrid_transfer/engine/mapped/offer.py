"""The producer's side of the mapped path: the handles of its registered cache regions (wire.MapOffer).

Offered only when this rank has a shared secret (the offer rides in the accepted reply of an authenticated
handshake: handshake.py) and ``read_transport`` is not "nixl", for a cache a consumer can map: a GPU
cache (CUDA IPC) or a cache this library allocated in shared memory. Staging pools are never offered:
a consumer reads those over NIXL.
"""

from __future__ import annotations

import logging

from hybrid_transfer.engine import wire
from hybrid_transfer.engine.mapped.host import host_key
from hybrid_transfer.errors import HybridTransferError

log = logging.getLogger(__name__)


def make_offer(cache, read_transport: str, secret: bytes | None) -> wire.MapOffer | None:
    """The MapOffer of ``cache``'s regions, or None when this rank offers none (and why, at debug level)."""
    if secret is None or read_transport == "nixl":
        return None
    host = host_key()
    if not host:
        log.debug("no host identity readable here: no mapping offered")
        return None
    regions = cache.regions
    if cache.device.type == "cuda":
        from hybrid_transfer.engine.mapped.cuda_ipc import export_handles

        kind = "cuda_ipc"
        try:
            handles = export_handles(cache.tensors)
        except (RuntimeError, HybridTransferError) as exc:
            log.warning("CUDA IPC handles of this cache cannot be exported (%s): consumers read over NIXL", exc)
            return None
    elif cache.shared_segments is not None:
        kind = "shm"
        handles = [name.encode() for name in cache.shared_segments.names]
    else:
        return None
    return wire.MapOffer(kind=kind, host=host, regions=tuple(
        wire.MapRegion(addr=r.addr, length=r.length, handle=h) for r, h in zip(regions, handles, strict=True)))
