"""Logical block ids to kernel block ids: what indexes a cache's per-kernel-block attention views.

An attention kernel may work on smaller kernel blocks inside a logical block (``kernel_ratio``
of them, consecutive in the page), so logical id ``L`` covers kernel blocks
``L*ratio .. L*ratio+ratio-1``. A peer's ids expand with the peer's own ratio: using the local
one silently reads the wrong bytes.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybrid_transfer.errors import ConfigError


def kernel_block_ids(block_ids: Iterable[int], kernel_ratio: int) -> list[int]:
    """Kernel block ids of ``block_ids``, in order: token ``t`` of the request sits in kernel block
    ``result[t // kernel_block_size]`` at position ``t % kernel_block_size``.

    Raises:
        ConfigError: a ratio that is not a positive integer, or a negative or non-integer block id.
    """
    if not isinstance(kernel_ratio, int) or isinstance(kernel_ratio, bool) or kernel_ratio <= 0:
        raise ConfigError(f"kernel_ratio={kernel_ratio!r} must be a positive integer", field="kernel_ratio",
                          value=kernel_ratio)
    out: list[int] = []
    for b in block_ids:
        if isinstance(b, bool) or not hasattr(b, "__index__") or int(b) < 0:
            raise ConfigError(f"block id {b!r} must be a non-negative integer", field="block_ids", value=b)
        first = int(b) * kernel_ratio
        out.extend(range(first, first + kernel_ratio))
    return out
