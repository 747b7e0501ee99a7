"""An Enum whose members hash by identity.

``enum.Enum.__hash__`` is Python code (it hashes the member's name), so every set or dict lookup of a
member costs a Python call; the consumer's step path makes several per request (a state change checks
its edge, a poll tests each request's state against the terminal ones). Members are singletons that
compare by identity, so the identity hash keeps ``a == b`` implying ``hash(a) == hash(b)`` and costs one
C call. Only the hash differs from Enum: values, names, pickling and msgspec are Enum's own.
"""

from __future__ import annotations

import enum


class IdentityEnum(enum.Enum):
    """Enum with the identity hash (module docstring)."""

    __hash__ = object.__hash__
