"""A consumer rank's quarantine: local blocks of failed or aborted requests, held until nothing can write them.

docs/lifecycle.md#deferred-free: a block changes owner only once every NIXL handle touching it is released (a READ in
flight, even one being cancelled, may still land bytes) and every engine step that may write it
has finished (fences.py). The consumer reports a failed or aborted request only when its entry
leaves the quarantine, so a reported request's blocks are safe to reuse.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from hybrid_transfer.engine.lifecycle.fences import StepFences


@dataclass(eq=False)
class _Entry:
    block_ids: tuple[int, ...]
    handles: list  # agent.XferHandle, the request's own list: a READ posted after the failure counts too


class Quarantine:
    """Entries keyed by request id; used by the consumer's owner thread only."""

    def __init__(self, fences: StepFences):
        self._fences = fences
        self._entries: dict[str, _Entry] = {}
        self._blocks: dict[int, int] = {}  # block id -> entries holding it

    def add(self, key: str, block_ids: Iterable[int], handles: list) -> None:
        """Quarantine ``block_ids`` until ``handles`` are released and the blocks' fences have passed.

        ``handles`` is kept by reference, so a handle appended to it later holds the entry too.
        """
        if key in self._entries:
            raise KeyError(f"{key!r} is already quarantined")
        entry = _Entry(tuple(int(b) for b in block_ids), handles)
        self._entries[key] = entry
        for b in entry.block_ids:
            self._blocks[b] = self._blocks.get(b, 0) + 1

    def sweep(self, release: Callable[[object], bool], keys: Iterable[str] | None = None) -> list[str]:
        """Try to release every pending handle (of ``keys``, or of all entries); return the keys let out now."""
        out = []
        for key in list(self._entries) if keys is None else [k for k in keys if k in self._entries]:
            entry = self._entries[key]
            held = [h for h in entry.handles if not release(h)]  # release() is True at once for released ones
            if held or not self._fences.is_clear(entry.block_ids):
                continue
            del self._entries[key]
            for b in entry.block_ids:
                left = self._blocks[b] - 1
                if left:
                    self._blocks[b] = left
                else:
                    del self._blocks[b]
            out.append(key)
        return out

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    @property
    def num_blocks(self) -> int:
        """Distinct blocks in quarantine."""
        return len(self._blocks)

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    @property
    def num_handles(self) -> int:
        """Handles NIXL has not let go of yet."""
        return sum(not h.is_released for e in self._entries.values() for h in e.handles)
