"""Checks the wire tests share: a body's round trip, every truncation, bit flips (engine/wire.py)."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st

from hybrid_transfer.engine import wire
from hybrid_transfer.errors import WireDecodeError


def assert_round_trip_and_truncations(body, digest: str) -> None:
    """``body`` decodes back equal from its envelope, and every prefix of that envelope is a WireDecodeError."""
    data = wire.encode(body, digest)
    assert wire.decode(data)[1] == body
    assert_every_truncation_refused(data)


def assert_every_truncation_refused(data: bytes, decode=wire.decode) -> None:
    for cut in range(len(data)):
        with pytest.raises(WireDecodeError):
            decode(data[:cut])


def decode_bit_flipped(data: st.DataObject, body, digest: str) -> None:
    """Flip 1 to 4 drawn bits of ``body``'s envelope and decode: the result is a body or our error, nothing else."""
    raw = bytearray(wire.encode(body, digest))
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] ^= 1 << data.draw(st.integers(0, 7))
    try:
        wire.decode(bytes(raw))
    except WireDecodeError:
        pass
