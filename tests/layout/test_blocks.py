"""Logical to kernel block ids: L expands to L*ratio .. L*ratio+ratio-1, in order; bad input is refused by name."""

import pytest

from hybrid_transfer import kernel_block_ids
from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import CacheOptions, KVLayout, RankGeometry


def test_ids_expand_by_the_ratio_in_order():
    assert kernel_block_ids([3, 0, 7], 1) == [3, 0, 7]
    assert kernel_block_ids([3, 0, 7], 4) == [12, 13, 14, 15, 0, 1, 2, 3, 28, 29, 30, 31]
    assert kernel_block_ids([], 3) == []


@pytest.mark.parametrize("ratio", [0, -1, 1.5, True, "2"])
def test_a_bad_ratio_is_refused(ratio):
    with pytest.raises(ConfigError) as err:
        kernel_block_ids([1], ratio)
    assert err.value.field == "kernel_ratio"


@pytest.mark.parametrize("block_id", [-1, 1.0, "3", None])
def test_a_bad_block_id_is_refused(block_id):
    with pytest.raises(ConfigError) as err:
        kernel_block_ids([0, block_id], 2)
    assert err.value.field == "block_ids" and err.value.value == block_id


@pytest.mark.parametrize("kv_layout", list(KVLayout))
def test_expanded_ids_index_the_kernel_blocks_of_the_logical_block(tiny_model, kv_layout):
    """Token t of a request sits in kernel block ids[t // kernel_block_size] of the k / v views."""
    g = RankGeometry(tiny_model, 1, 0, CacheOptions(block_size=32, kernel_block_size=8, kv_layout=kv_layout))
    cache = HybridCache.allocate(g, num_blocks=4)
    layer = tiny_model.attention_layers[0]
    ids = kernel_block_ids([2, 0], g.kernel_ratio)
    token = 45  # the request's logical block 0 (id 2) holds tokens 0-31, its block 1 (id 0) tokens 32-63
    cache.v(layer)[ids[token // g.kernel_block_size], 1, token % g.kernel_block_size] = 1.0
    raw = cache.raw(g.tensor_of(layer)).view(-1)
    offset = g.kv_offset(0, (token - 32) // 8, half=1, head_slot=1, token=token % 8)
    assert raw[offset : offset + g.head_token_bytes].any()
    assert int(raw.count_nonzero()) == int(raw[offset : offset + g.head_token_bytes].count_nonzero())
