"""Logical to kernel block ids: L expands to L*ratio .. L*ratio+ratio-1, in order; bad input is refused by name."""

import pytest

from hybrid_transfer import kernel_block_ids
from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import CacheOptions, RankGeometry


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


def test_expanded_ids_index_the_kernel_blocks_of_the_logical_block(tiny_model):
    """Token t of a request sits in kernel block ids[t // kernel_block_size] of the cache's attention view."""
    g = RankGeometry(tiny_model, 1, 0, CacheOptions(block_size=32, kernel_block_size=8))
    cache = HybridCache.allocate(g, num_blocks=4)
    layer = tiny_model.attention_layers[0]
    kv = cache.kv(layer)  # [num_kernel_blocks, ...]
    ids = kernel_block_ids([2, 0], g.kernel_ratio)
    token = 45  # logical block 0 of the request (id 2) holds tokens 0-31, id 0 holds 32-63
    kv[ids[token // g.kernel_block_size], :, :, token % g.kernel_block_size] = 1
    addr, _ = cache.kv_range(layer, 0, (token - 32) // 8, 0)
    offset = addr - cache.raw(g.tensor_of(layer)).data_ptr() + (token % 8) * g.head_token_bytes
    assert cache.raw(g.tensor_of(layer)).view(-1)[offset : offset + g.head_token_bytes].any()
