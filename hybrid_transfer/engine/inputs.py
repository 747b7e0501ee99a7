"""Type and range checks of what embedders pass to hold() and start_read(), before anything is pinned.

Python lets a bool pass for an int and numpy turns ``[1, True]`` into ``[1, 1]``; a value that
passes here but could not travel in a ticket (a nonce of 2**64, an int request id) would pin blocks
under a ticket no consumer can decode. Every refusal names the argument and its value.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import numpy as np

from hybrid_transfer.engine.wire import MAX_NAME_CHARS, MAX_NONCE, MAX_REQUEST_ID_CHARS
from hybrid_transfer.errors import ConfigError, PlanError


def is_integer(value: object) -> bool:
    """An int or numpy integer, never a bool (Python's or numpy's)."""
    return isinstance(value, (numbers.Integral, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(field: str, value: object) -> int:
    """A non-negative integer argument (token counts, state positions), as a Python int."""
    if not is_integer(value) or int(value) < 0:  # type: ignore[call-overload]
        raise ConfigError(f"{field}={value!r} must be a non-negative integer (not a bool)", field=field,
                          value=value)
    return int(value)  # type: ignore[call-overload]


def nonce(field: str, value: object) -> int:
    """A nonce or incarnation: an integer in [0, 2**63), the range a ticket carries."""
    if not is_integer(value) or not 0 <= int(value) <= MAX_NONCE:  # type: ignore[call-overload]
        raise ConfigError(f"{field}={value!r} must be an integer in [0, 2**63)", field=field, value=value)
    return int(value)  # type: ignore[call-overload]


def request_id(value: object) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_REQUEST_ID_CHARS:
        shown = f"{value[:40]!r}... ({len(value)} characters)" if isinstance(value, str) and value else repr(value)
        raise ConfigError(f"request_id={shown} must be a non-empty str of at most {MAX_REQUEST_ID_CHARS} "
                          "characters", field="request_id", value=value)
    return value


# Agent names are the engine id plus "-p<rank>-<incarnation in hex>" (or "-c<rank>-<8 hex>"), and must
# stay within the wire's name cap.
MAX_ENGINE_ID_CHARS = MAX_NAME_CHARS - 48


def engine_id(value: object) -> str:
    """An engine id: it travels in tickets, and prefixes the agent names sent in handshakes."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ENGINE_ID_CHARS:
        shown = f"{value[:40]!r}... ({len(value)} characters)" if isinstance(value, str) and value else repr(value)
        raise ConfigError(f"engine_id={shown} must be a non-empty str of at most {MAX_ENGINE_ID_CHARS} characters",
                          field="engine_id", value=value)
    return value


def block_id_lists(side: str, block_ids_per_group: object) -> None:
    """Every group a flat sequence (or array) of integers; the planner's checks of counts and ranges follow."""
    if isinstance(block_ids_per_group, (str, bytes)) or not isinstance(block_ids_per_group, (Sequence, np.ndarray)):
        raise PlanError(f"{side} block ids must be one sequence of integers per cache group, got "
                        f"{block_ids_per_group!r}", side=side, block_ids=block_ids_per_group)
    for group, ids in enumerate(block_ids_per_group):
        if isinstance(ids, np.ndarray):
            if ids.ndim != 1 or ids.dtype.kind not in "iu":
                raise PlanError(f"{side} group {group}: block ids must be a flat list of integers, got an array "
                                f"of {ids.dtype} with shape {ids.shape}", side=side, group=group, block_ids=ids)
            continue
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise PlanError(f"{side} group {group}: block ids must be a flat list of integers, got {ids!r}",
                            side=side, group=group, block_ids=ids)
        for b in ids:
            if type(b) is not int and not is_integer(b):  # the exact-type test keeps long lists cheap
                raise PlanError(f"{side} group {group}: block ids must be integers (not bools), got {b!r} in "
                                f"{list(ids)[:16]!r}", side=side, group=group, block_ids=ids)
