"""The valid bytes of one request in vLLM's cache views, compared between a decode cache and the source's.

Valid bytes: every attention layer's K|V of the first N-1 token positions (vLLM 0.33's
``[blocks, heads, tokens, K|V]`` pages: a position is one ``[:, :, t, :]`` slice of every head)
and every GDN layer's whole state row in the request's state block. Page tails and padding are
not compared: the two connectors treat them differently (vLLM's moves whole pages, ours zeroes
the tail) and neither is part of the request's cache. The walk uses only vLLM's views and the
KVCacheConfig's layer -> group map, not either connector's code.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence

from hybrid_transfer.errors import VerificationError


def _is_state(spec) -> bool:
    return type(spec).__name__ == "MambaSpec"


def valid_slices(kvc, caches: dict, block_ids: Sequence[Sequence[int]], num_tokens: int) -> Iterator[tuple]:
    """(layer name, tensor slice) of every valid region of a request, in a fixed order.

    ``block_ids``: the request's ids per vLLM group (``select_transfer_block_ids``).
    """
    for g, group in enumerate(kvc.kv_cache_groups):
        spec = group.kv_cache_spec
        ids = block_ids[g]
        for name in group.layer_names:
            view = caches[name]
            if _is_state(spec):
                yield name, view[ids[-1]]
                continue
            block_size = spec.block_size
            kernel = view.shape[2]  # [kernel blocks, heads, kernel tokens, K|V]
            ratio = block_size // kernel
            for i in range(-(-num_tokens // block_size)):
                valid = min(block_size, num_tokens - i * block_size)
                for k in range(ratio):
                    n = min(kernel, valid - k * kernel)
                    if n <= 0:
                        break
                    yield name, view[ids[i] * ratio + k, :, :n, :]


def compare(kvc, actual: dict, actual_ids, expected: dict, expected_ids, num_tokens: int,
            request_id: str) -> tuple[int, str]:
    """Check a request's valid bytes in ``actual`` against ``expected``; return (bytes, sha256 of them).

    Raises:
        VerificationError: the first layer whose bytes differ, with the request and the count of bad bytes.
    """
    h = hashlib.sha256()
    nbytes = 0
    pairs = zip(valid_slices(kvc, actual, actual_ids, num_tokens),
                valid_slices(kvc, expected, expected_ids, num_tokens), strict=True)
    for (name, got), (_, want) in pairs:
        got_bytes = got.contiguous().view(-1).view(dtype=_u8()).cpu().numpy()  # .cpu(): a CPU tensor as it is
        want_bytes = want.contiguous().view(-1).view(dtype=_u8()).cpu().numpy()
        bad = got_bytes != want_bytes
        if bad.any():
            first = int(bad.argmax())
            raise VerificationError(
                f"request {request_id}: {int(bad.sum())} bad byte(s) in layer {name}, first at byte {first} of its "
                f"valid region (decode ids {[list(g) for g in actual_ids]}, source ids "
                f"{[list(g) for g in expected_ids]}): expected 0x{int(want_bytes[first]):02x}, found "
                f"0x{int(got_bytes[first]):02x}", tensor_index=-1, first_bad_offset=first,
                num_bad_bytes=int(bad.sum()), block_id=-1, location=name, expected_byte=int(want_bytes[first]),
                actual_byte=int(got_bytes[first]))
        h.update(got_bytes.tobytes())
        nbytes += got_bytes.size
    return nbytes, h.hexdigest()


def _u8():
    import torch

    return torch.uint8
