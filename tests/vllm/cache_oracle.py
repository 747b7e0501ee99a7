"""The expected bytes of a decode rank after loads through the connector.

The library's oracle (hybrid_transfer.verify) knows the pattern at every global coordinate and
poison elsewhere. After a load, the connector also zeroes the token tail of the last attention
block it filled (vLLM would otherwise leave stale bytes there); this module writes those zeros
into the expected image through the layout-independent K and V views, so the check stays
independent of the connector's own zeroing code (which works on vLLM's views).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import VerificationError
from hybrid_transfer.layout.model import LayerKind
from hybrid_transfer.verify import RequestLayout, describe_byte, expected_destination_many


def _zero_tail(image: HybridCache, layout: RequestLayout) -> None:
    g = image.geometry
    n = layout.num_tokens
    if n % g.block_size == 0:
        return
    for group, ids in zip(g.tensor_map.groups, layout.block_ids, strict=True):
        if group.kind is not LayerKind.ATTENTION:
            continue
        block = ids[n // g.block_size]
        for layer in group.layers:
            for view in (image.k(layer), image.v(layer)):  # [kernel blocks, heads, kernel tokens, head_dim]
                for t in range(n % g.block_size, g.block_size):
                    kernel, pos = divmod(t, g.kernel_block_size)
                    view[block * g.kernel_ratio + kernel, :, pos] = 0


def check_after_load(cache: HybridCache, layouts_and_seeds: Sequence[tuple[RequestLayout, int]],
                     zero_tails: bool) -> None:
    """Compare every byte of ``cache`` with the expected image; raise VerificationError naming the first bad one."""
    expected = HybridCache.wrap(cache.geometry, expected_destination_many(cache, layouts_and_seeds))
    if zero_tails:
        for layout, _ in layouts_and_seeds:
            _zero_tail(expected, layout)
    num_bad = 0
    first = None
    for index, (actual, want) in enumerate(zip(cache.tensors, expected.tensors, strict=True)):
        bad = actual != want
        if bool(bad.any()):
            num_bad += int(bad.sum())
            if first is None:
                first = (index, int(bad.to(torch.uint8).argmax()))
    if first is None:
        return
    index, offset = first
    block_id, where = describe_byte(cache.geometry, [r for r, _ in layouts_and_seeds], index, offset)
    want, got = int(expected.tensors[index][offset]), int(cache.tensors[index][offset])
    raise VerificationError(f"{num_bad} bad byte(s); first at tensor {index} offset {offset}: {where}: expected "
                            f"0x{want:02x}, found 0x{got:02x}", tensor_index=index, first_bad_offset=offset,
                            num_bad_bytes=num_bad, block_id=block_id, location=where, expected_byte=want,
                            actual_byte=got)
