"""The ceiling: one READ of a request's bytes per (decode rank, source) as a single descriptor.
And below it the physical limit (``CopySource``): the same bytes moved by one torch copy per source.

The cache's shared tensors are far smaller than a request's bytes (a 397B request spans 15
tensors), and an agent registers its regions once. So each rank process holds a second, bare
NIXL agent (the engine's NixlAgent, same EngineConfig) over one flat buffer: ``slots`` slots
per rank, one per request in flight, so concurrent reads never share bytes. Same processes,
same transport, same post/check path as the engine's reads; no plan and no notification.

Buffers carry a periodic counter-hash pattern (copied, not computed, per byte) with bit 0 of every byte clear; poison (0xA5) has it
set, so a byte the READ never wrote cannot pass the check.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from hybrid_transfer.cache import Region
from hybrid_transfer.engine.agent import NixlAgent, XferHandle
from hybrid_transfer.engine.config import EngineConfig
from hybrid_transfer.errors import ConfigError, VerificationError
from hybrid_transfer.verify import POISON_BYTE

_PERIOD = 1_048_573  # a prime number of bytes: a segment read from a wrong offset does not line up
_MUL = -7046029254386353131  # 0x9E3779B97F4A7C15 as a signed int64 (torch multiplication wraps)


def fill_pattern(buf: torch.Tensor, seed: int) -> None:
    """Write the pattern of ``seed`` into a flat uint8 tensor (byte o holds period[o % _PERIOD])."""
    base = _period(seed, buf.device)
    for pos, phase, take in _pieces(0, buf.numel()):
        buf[pos : pos + take] = base[phase : phase + take]


def check_pattern(buf: torch.Tensor, seed: int, offset: int, what: str) -> None:
    """Raise VerificationError unless ``buf`` holds bytes [offset, offset + len) of the pattern of ``seed``."""
    base = _period(seed, buf.device)
    for pos, phase, take in _pieces(offset, buf.numel()):
        got, want = buf[pos : pos + take], base[phase : phase + take]
        if not torch.equal(got, want):
            bad = int((got != want).nonzero()[0].item())
            raise VerificationError(
                f"{what}: byte {pos + bad} is 0x{int(got[bad]):02x}, expected 0x{int(want[bad]):02x}",
                tensor_index=-1, first_bad_offset=pos + bad, num_bad_bytes=int((got != want).sum()), block_id=-1,
                location=what, expected_byte=int(want[bad]), actual_byte=int(got[bad]))


def _pieces(offset: int, n: int):
    """(position in the buffer, phase in the period, length) covering [offset, offset + n) of the pattern."""
    pos, phase = 0, offset % _PERIOD
    while pos < n:
        take = min(_PERIOD - phase, n - pos)
        yield pos, phase, take
        pos += take
        phase = 0


def _period(seed: int, device: torch.device) -> torch.Tensor:
    """One period of the pattern: a counter hash, bit 0 of every byte clear (never the poison byte)."""
    x = torch.arange(_PERIOD, dtype=torch.int64, device=device) + ((seed & 0x7FFFF) << 40)
    x = x * _MUL
    x = x ^ (x >> 29)
    x = x * _MUL
    return ((x >> 40) & 0xFE).to(torch.uint8)


@dataclass(frozen=True)
class CeilingPeer:
    """A source rank's ceiling buffer as a decode rank sees it."""

    agent_name: str
    base: int
    slot_bytes: int
    device_id: int
    seed: int


class CeilingEnd:
    """One rank's ceiling buffer and agent. Owned by the rank process's main thread."""

    def __init__(self, name: str, config: EngineConfig, slots: int, slot_bytes: int, device: torch.device):
        if slots < 1 or slot_bytes < 1:
            raise ConfigError(f"ceiling needs slots >= 1 and slot_bytes >= 1, got {slots} x {slot_bytes}",
                              field="ceiling", value=(slots, slot_bytes))
        self.slots, self.slot_bytes = slots, slot_bytes
        # Written now, like the caches (torch.zeros): untouched pages would fault inside the timed READs.
        self.buffer = torch.full((slots * slot_bytes,), POISON_BYTE, dtype=torch.uint8, device=device)
        self.device_id = (device.index or 0) if device.type == "cuda" else 0
        self.agent = NixlAgent(name, config, device_memory=device.type == "cuda")
        self.agent.register([Region(self.buffer.data_ptr(), self.buffer.numel(), self.device_id,
                                    device.type == "cuda")])
        self.peers: dict[int, CeilingPeer] = {}  # source rank -> its buffer (decode ranks only)

    @property
    def base(self) -> int:
        return self.buffer.data_ptr()

    def add_source(self, rank: int, metadata: bytes, base: int, slot_bytes: int, device_id: int, seed: int) -> None:
        name = self.agent.add_remote(metadata)
        self.peers[rank] = CeilingPeer(name, base, slot_bytes, device_id, seed)

    def post(self, slot: int, lengths: Mapping[int, int]) -> list[XferHandle]:
        """One single-descriptor READ per source, into consecutive segments of local ``slot``."""
        handles, offset = [], slot * self.slot_bytes
        for rank in sorted(lengths):
            n = lengths[rank]
            if n == 0:
                continue
            peer = self.peers[rank]
            local = np.array([[self.base + offset, n, self.device_id]], dtype=np.int64)
            remote = np.array([[peer.base + slot * peer.slot_bytes, n, peer.device_id]], dtype=np.int64)
            handles.append(self.agent.post_read(peer.agent_name, local, remote))
            offset += n
        return handles

    def check_slot(self, slot: int, lengths: Mapping[int, int]) -> None:
        """Each source's segment of ``slot`` holds that source's slot bytes; the rest of the slot is poison."""
        offset = slot * self.slot_bytes
        for rank in sorted(lengths):
            n, peer = lengths[rank], self.peers[rank]
            check_pattern(self.buffer[offset : offset + n], peer.seed, slot * peer.slot_bytes,
                          f"ceiling slot {slot}, segment of source rank {rank}")
            offset += n
        rest = self.buffer[offset : (slot + 1) * self.slot_bytes]
        if rest.numel() and not bool((rest == POISON_BYTE).all()):
            raise VerificationError(f"ceiling slot {slot}: bytes past the read segments were written",
                                    tensor_index=-1, first_bad_offset=offset, num_bad_bytes=-1, block_id=-1,
                                    location="ceiling", expected_byte=POISON_BYTE, actual_byte=-1)

    def close(self) -> None:
        self.agent.close()


class CopySource:
    """The physical-limit row: per source, one torch copy of the bytes the ceiling READs from it.

    A decode rank allocates, for each source rank it reads, a buffer of that source's bytes per
    request on the source's device (its own GPU when both sides share one, the prefill GPU
    otherwise), filled with that source's pattern; each request copies it into the rank's ceiling
    slot, as the ceiling's READ does, on a stream of its own (CPU: inside the call). No NIXL, no
    plan: what the memory (and, across GPUs, the link) moves when nothing else is in the way.
    """

    def __init__(self, ceiling: CeilingEnd, sources: Mapping[int, tuple[int, torch.device, int]]):
        self.ceiling = ceiling
        self.buffers: dict[int, torch.Tensor] = {}
        self.seeds: dict[int, int] = {}
        for rank, (nbytes, device, seed) in sorted(sources.items()):
            buf = torch.empty(max(1, nbytes), dtype=torch.uint8, device=device)
            fill_pattern(buf, seed)
            self.buffers[rank], self.seeds[rank] = buf, seed
        dst = ceiling.buffer.device
        self._stream = torch.cuda.Stream(dst) if dst.type == "cuda" else None

    def post(self, slot: int, lengths: Mapping[int, int]):
        """Copy every source's bytes into ``slot``; returns the CUDA end event (None on CPU: done)."""
        offset = slot * self.ceiling.slot_bytes
        buf = self.ceiling.buffer
        if self._stream is None:
            for rank in sorted(lengths):
                n = lengths[rank]
                buf[offset : offset + n].copy_(self.buffers[rank][:n])
                offset += n
            return None
        self._stream.wait_stream(torch.cuda.current_stream(buf.device))
        with torch.cuda.stream(self._stream):
            for rank in sorted(lengths):
                n = lengths[rank]
                buf[offset : offset + n].copy_(self.buffers[rank][:n], non_blocking=True)
                offset += n
            end = torch.cuda.Event()
            end.record()
        return end

    def check_slot(self, slot: int, lengths: Mapping[int, int]) -> None:
        """Each source's segment of ``slot`` holds that source's buffer (pattern from offset 0)."""
        offset = slot * self.ceiling.slot_bytes
        for rank in sorted(lengths):
            n = lengths[rank]
            check_pattern(self.ceiling.buffer[offset : offset + n], self.seeds[rank], 0,
                          f"copy slot {slot}, segment of source rank {rank}")
            offset += n
