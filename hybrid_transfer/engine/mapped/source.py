"""One producer agent's cache as this consumer mapped it, and the handle of a READ over it.

``MappedSource`` holds the opened regions of one producer agent (shm.py or cuda_ipc.py), sorted by
their producer addresses. A READ's remote descriptors are producer addresses: ``translate`` finds each
range's region with one searchsorted and checks it ends inside it (numpy, no loop per range), so a range
the producer did not offer raises before any byte moves. ``invalidate`` (the agent is gone, its engine
restarted with a new incarnation, its link dropped) makes every later post raise; ``close`` unmaps once
no copy can still read the mapping.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybrid_transfer.engine.agent import XferState
from hybrid_transfer.errors import EngineError, MappingError, PeerDisconnectedError, RangeError


class MappedRead:
    """A READ posted over a mapping: NIXL's XferHandle's fields, its completion the end of the call or an event."""

    __slots__ = ("peer", "state", "num_descriptors", "num_bytes", "error", "event", "shares", "posted", "kind",
                 "checked_in")

    def __init__(self, peer: str, kind: str, num_descriptors: int, num_bytes: int, event=None):
        self.peer = peer
        self.kind = kind
        self.num_descriptors = num_descriptors
        self.num_bytes = num_bytes
        self.event = event  # CUDA: recorded after the copy; None: the copy ran inside the post
        self.state = XferState.PROC if event is not None else XferState.DONE
        self.error: EngineError | None = None
        self.shares = 0  # SharedRead views not yet let go (engine/agent.py)
        self.posted = True
        self.checked_in = -1  # the check scope its event was last queried in (NixlAgent.check_scope)

    @property
    def is_released(self) -> bool:
        return self.state is XferState.RELEASED

    def poll(self, scope: int = -1) -> XferState:
        """DONE once the event has passed; inside a check scope (``scope`` >= 0) the event is queried once:
        every request of a step shares this READ, and a poll looks at each of them."""
        if self.state is XferState.PROC and (scope < 0 or self.checked_in != scope):
            self.checked_in = scope
            if self.event.query():
                self.state = XferState.DONE
        return self.state

    def can_free(self) -> bool:
        """Nothing can still write through it (its copy has finished)."""
        return self.event is None or self.state is not XferState.PROC or self.event.query()


class MappedSource:
    """The opened regions of one producer agent: (producer address, length) -> address here."""

    def __init__(self, peer: str, kind: str, remote_addrs: Sequence[int], lengths: Sequence[int], mappings: Sequence):
        order = np.argsort(np.asarray(remote_addrs, np.int64))
        self.peer, self.kind = peer, kind
        self._mappings = [mappings[i] for i in order]
        self._base = np.asarray(remote_addrs, np.int64)[order]
        self._end = self._base + np.asarray(lengths, np.int64)[order]
        self._local = np.asarray([m.addr for m in self._mappings], np.int64)
        if np.any(self._end[:-1] > self._base[1:]):
            raise MappingError(f"the producer's offered regions of {peer} overlap", peer=peer)
        self.invalid_reason = ""  # set by invalidate: every later post raises
        self.pending: set[MappedRead] = set()  # CUDA reads not yet released: close waits for those still copying
        self.copies = 0  # posts that moved bytes over this mapping

    @property
    def is_valid(self) -> bool:
        return not self.invalid_reason and bool(self._mappings)

    def covers(self, remote_addr: np.ndarray, length: np.ndarray) -> bool:
        """Whether every range lies inside one offered region (staging pools are not offered: those go on NIXL)."""
        return self.translate_covered(remote_addr, length) is not None

    def translate_covered(self, remote_addr: np.ndarray, length: np.ndarray) -> np.ndarray | None:
        """``translate`` of a valid mapping's ranges when every one lies inside an offered region, else None
        (nothing raised): the post's choice and its translation from one lookup."""
        i = np.searchsorted(self._base, remote_addr, side="right") - 1
        if (i < 0).any() or (remote_addr + length > self._end[i]).any():  # the second only once every i >= 0
            return None
        return self._local[i] + (remote_addr - self._base[i])

    def translate(self, remote_addr: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Producer addresses -> addresses of the mapping here.

        Raises:
            PeerDisconnectedError: the mapping was invalidated (its ``invalid_reason`` named).
            RangeError: a range outside every offered region (the first one named).
        """
        if not self.is_valid:
            raise PeerDisconnectedError(f"the mapping of {self.peer} is invalid: {self.invalid_reason or 'closed'}",
                                        operation="post mapped READ", agent="-", peer=self.peer)
        i = np.searchsorted(self._base, remote_addr, side="right") - 1
        bad = (i < 0) | (remote_addr + length > self._end[np.maximum(i, 0)])
        if bad.any():
            k = int(np.flatnonzero(bad)[0])
            raise RangeError(side=f"remote ({self.peer}, mapped)", addr=int(remote_addr[k]), length=int(length[k]))
        return self._local[i] + (remote_addr - self._base[i])

    def invalidate(self, reason: str) -> None:
        if not self.invalid_reason:
            self.invalid_reason = reason

    def close(self) -> list[MappedRead]:
        """Invalidate, then unmap once no copy reads it; the reads still copying (unmapping waits for those)."""
        self.invalidate("the link was closed")
        self.pending = {r for r in self.pending if not r.can_free()}
        if self.pending:
            return list(self.pending)
        for m in self._mappings:
            m.close()
        self._mappings = []
        return []
