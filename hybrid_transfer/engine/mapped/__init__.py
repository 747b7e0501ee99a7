"""The mapped read path (issue 28): a consumer that can map its producer's cache copies a step in one call.

Where both ranks sit on one host and a shared secret authenticated the handshake, the producer's accepted
reply carries a handle per registered region (wire version 11, ``MapOffer``): the name of a shared-memory
segment for caches this library allocated on a CPU host (``HybridCache.allocate(shared=True)``), or a
CUDA IPC handle for a GPU cache. The consumer opens the handles once per link (``ReadTransports.attach``)
and from then on posts that producer agent's READs as one copy call: numpy row copies over the mapped
pages on a CPU host, one gather kernel over a table of ranges on a GPU (docs/tuning.md#mapped-reads).
Everything around the copy (claims, quarantine, leases, reports) stays the consumer's one implementation:
a mapped READ is a handle like NIXL's (``MappedRead``), its completion a CUDA event or the end of the call.

Modules: host.py (whether two ranks share a host), shm.py (shared-memory caches), host_copy.py (the CPU
copy), cuda_ipc.py (CUDA IPC handles and the gather kernel), offer.py (the producer's handles),
source.py (one producer agent's opened mapping and the MappedRead handle), transport.py (the seam).
"""

from hybrid_transfer.engine.mapped.transport import ReadTransports

__all__ = ["ReadTransports"]
