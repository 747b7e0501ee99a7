"""The read transport seam: a consumer posts every READ through one object, over NIXL or over a mapping.

The choice is per producer agent, made once at its handshake (``attach``): the producer's offer
(wire.MapOffer, only in an authenticated reply), this host's key and the kinds this rank can open
(host.py) decide, and ``EngineConfig.read_transport`` overrides ("nixl": never map). The consumer's
lifecycle (claims, quarantine, leases, reports) sees only handles: ``post_read``, ``check`` and
``release`` take NIXL's XferHandle, a MappedRead (source.py) and a SharedRead of either alike.

A READ on a mapped agent whose ranges all lie in the offered regions is one copy call (host_copy.py on
a CPU host, cuda_ipc.RangeCopier's one kernel launch on a GPU); a READ from that agent's staging (pack
mode; not offered) goes over NIXL. After ``invalidate`` (the agent gone, its engine's incarnation
replaced) or ``detach`` (its link dropped) every post on it raises PeerDisconnectedError before any byte
moves; ``detach`` unmaps once no kernel can still read the mapping.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import numpy as np

from hybrid_transfer.engine import wire
from hybrid_transfer.engine.agent import NixlAgent, SharedRead, XferState
from hybrid_transfer.engine.mapped import host_copy
from hybrid_transfer.engine.mapped.host import can_open, host_key
from hybrid_transfer.engine.mapped.source import MappedRead, MappedSource
from hybrid_transfer.errors import MappingError, PlanError, RangeError

log = logging.getLogger(__name__)

NIXL = "nixl"


class ReadTransports:
    """One consumer rank's READs, each over NIXL or a mapping (module docstring); the owner thread's only."""

    def __init__(self, agent: NixlAgent, cache, read_transport: str = "auto"):
        self.nixl = agent
        self._on_gpu = cache.device.type == "cuda"
        self._device = cache.device
        self.kinds: tuple[str, ...] = () if read_transport == NIXL else tuple(
            k for k in wire.MAP_KINDS if can_open(k, on_gpu=self._on_gpu))
        regions = cache.regions
        order = np.argsort([r.addr for r in regions])
        self._local_base = np.asarray([regions[i].addr for i in order], np.int64)
        self._local_end = self._local_base + np.asarray([regions[i].length for i in order], np.int64)
        self._sources: dict[str, MappedSource] = {}
        self._closing: list[MappedSource] = []  # detached with copies in flight: unmapped once they finish
        self._live: set[MappedRead] = set()
        self._owner: dict[MappedRead, MappedSource] = {}  # GPU reads -> the mapping they copy from
        self._copier = None  # cuda_ipc.RangeCopier, made at the first GPU attach
        self.reads: Counter[str] = Counter()  # READs posted, by transport ("nixl", "shm", "cuda_ipc")
        self.bytes: Counter[str] = Counter()  # ... their bytes

    # ---- the handshake ----------------------------------------------------------------------
    def request_fields(self) -> dict:
        """HandshakeRequest's version 11 fields: this host and the kinds this rank can open."""
        host = host_key() if self.kinds else ""
        return {"map_host": host, "map_kinds": self.kinds if host else ()}

    def attach(self, peer: str, offer: wire.MapOffer | None, expected: Sequence[tuple[int, int]]) -> str:
        """Open ``peer``'s offered regions (``expected``: its descriptor's (address, bytes) per region); the
        transport its READs take from now on ("nixl" when there is no usable offer)."""
        self.detach(peer)
        if offer is None or offer.kind not in self.kinds or not offer.host or offer.host != host_key():
            return NIXL
        if sorted((r.addr, r.length) for r in offer.regions) != sorted(expected):
            log.warning("producer agent %s offers regions other than its descriptor's: reading over NIXL", peer)
            return NIXL
        opened = []
        try:
            for r in offer.regions:
                opened.append(self._open(offer.kind, r))
            source = MappedSource(peer, offer.kind, [r.addr for r in offer.regions],
                                  [r.length for r in offer.regions], opened)
        except MappingError as exc:
            for m in opened:
                m.close()
            log.warning("cannot map producer agent %s (%s): reading over NIXL", peer, exc)
            return NIXL
        self._sources[peer] = source
        log.info("consumer %s reads producer agent %s over %s", self.nixl.name, peer, offer.kind)
        return offer.kind

    def _open(self, kind: str, region: wire.MapRegion):
        if kind == "shm":
            from hybrid_transfer.engine.mapped.shm import ReadOnlyMapping

            try:
                name = region.handle.decode("ascii")
            except UnicodeDecodeError as exc:
                raise MappingError(f"undecodable shared-memory name: {exc}") from exc
            return ReadOnlyMapping(name, region.length)
        from hybrid_transfer.engine.mapped.cuda_ipc import IpcMapping, RangeCopier

        if self._copier is None:
            self._copier = RangeCopier(self._device)
        return IpcMapping(region.handle, region.length, self._device)

    def transport_of(self, peer: str) -> str:
        source = self._sources.get(peer)
        return source.kind if source is not None and source.is_valid else NIXL

    @property
    def mapped_agents(self) -> dict[str, str]:
        """Producer agent -> mapping kind, for every agent read over a valid mapping."""
        return {p: s.kind for p, s in self._sources.items() if s.is_valid}

    def invalidate(self, peer: str, reason: str) -> None:
        """No READ on ``peer``'s mapping after this (its agent is gone, or its engine restarted)."""
        source = self._sources.get(peer)
        if source is not None:
            source.invalidate(reason)

    def detach(self, peer: str) -> None:
        """``peer``'s link is gone: invalidate its mapping and unmap it once no copy reads it."""
        source = self._sources.pop(peer, None)
        if source is not None and source.close():
            self._closing.append(source)

    # ---- reads ------------------------------------------------------------------------------
    def post_read(self, peer: str, local_descs: np.ndarray, remote_descs: np.ndarray):
        """One READ of ``remote_descs`` on ``peer`` into ``local_descs`` (Nx3 int64: address, bytes, device).

        Raises:
            PeerDisconnectedError: ``peer``'s mapping was invalidated (nothing moved).
            RangeError / PlanError: a range outside the mapped or the local regions, or lengths that differ
                (nothing moved).
            EngineError: NIXL's, for READs over NIXL.
        """
        source = self._sources.get(peer)
        n = int(local_descs.shape[0])
        src_addr = None
        if source is not None and source.is_valid:
            src_addr = source.translate_covered(remote_descs[:, 0], remote_descs[:, 1])
        if source is None or (source.is_valid and src_addr is None):  # not mapped, or a range it does not offer
            handle = self.nixl.post_read(peer, local_descs, remote_descs)
            self.reads[NIXL] += 1
            self.bytes[NIXL] += handle.num_bytes
            return handle
        if src_addr is None:
            src_addr = source.translate(remote_descs[:, 0], remote_descs[:, 1])  # raises: the mapping is invalid
        lengths = np.ascontiguousarray(local_descs[:, 1])
        if remote_descs.shape[0] != n or np.any(remote_descs[:, 1] != lengths):
            raise PlanError(f"a mapped READ of {peer} pairs ranges of different lengths")
        dst = np.ascontiguousarray(local_descs[:, 0])
        self._check_local(dst, lengths)
        if self._on_gpu:
            event = self._copier.copy(dst, src_addr, lengths)
            read = MappedRead(peer, source.kind, n, int(lengths.sum()), event)
            source.pending.add(read)
            self._owner[read] = source
        else:
            moved = host_copy.copy_ranges(dst, src_addr, lengths)
            read = MappedRead(peer, source.kind, n, moved)
        source.copies += 1
        self._live.add(read)
        self.reads[source.kind] += 1
        self.bytes[source.kind] += read.num_bytes
        return read

    def _check_local(self, dst: np.ndarray, lengths: np.ndarray) -> None:
        i = np.searchsorted(self._local_base, dst, side="right") - 1
        bad = (i < 0) | (dst + lengths > self._local_end[np.maximum(i, 0)])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise RangeError(side="local (mapped READ)", addr=int(dst[k]), length=int(lengths[k]))

    def check(self, handle) -> XferState:
        base = handle.base if isinstance(handle, SharedRead) else handle
        if isinstance(base, MappedRead):
            return base.poll(self.nixl.check_scope)
        return self.nixl.check(handle)

    def one_check_per_handle(self):
        return self.nixl.one_check_per_handle()

    def release(self, handle) -> bool:
        """Let go of a handle; False while it may still write (NIXL's refusal, or a copy still running)."""
        if isinstance(handle, SharedRead) and isinstance(handle.base, MappedRead):
            if not handle.dropped:
                handle.dropped = True
                handle.base.shares -= 1
            if handle.base.shares > 0:
                return False
            return self._free(handle.base)
        if isinstance(handle, MappedRead):
            return self._free(handle)
        return self.nixl.release(handle)

    def _free(self, read: MappedRead) -> bool:
        if read.is_released:
            return True
        if not read.can_free():
            return False
        read.state = XferState.RELEASED
        self._live.discard(read)
        source = self._owner.pop(read, None)
        if source is not None:
            source.pending.discard(read)
        self._sweep_closing()
        return True

    def _sweep_closing(self) -> None:
        if self._closing:
            self._closing = [s for s in self._closing if s.close()]

    @property
    def num_live_handles(self) -> int:
        """Handles that could still write: NIXL's and the mapped path's."""
        return self.nixl.num_live_handles + len(self._live)

    def close(self) -> None:
        """Unmap everything (waiting for the copies still queued: a kernel must never read an unmapped page)."""
        if self._copier is not None:
            self._copier.synchronize()
        for peer in list(self._sources):
            self.detach(peer)
        self._sweep_closing()
        self._live.clear()
        self._owner.clear()
