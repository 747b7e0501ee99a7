"""Prefix caching with different block sizes on the two sides, through vLLM 0.33's real schedulers and real
NIXL between processes (docs/vllm.md#prefix-caching): what vLLM's own connector leaves as a TODO.

The decode engine caches (``mamba_cache_mode='align'``); the prefill engine does not. Turn 1 loads a prompt
whose N-1 ends on a decode block boundary, so vLLM caches the loaded blocks and the state there. Turn 2
extends it: decode hits turn 1's blocks, loads only the tokens past the hit from the prefill engine's
turn-2 blocks, and every byte of the decode cache is checked against the global-coordinate oracle:
turn 1's bytes in the hit's blocks (never written by turn 2's read), turn 2's past them and its state.
With decode blocks half the prefill's, the hit ends in the middle of a prefill block. The stand-in
attention backend is token-major (attention_stand_in.py), as the GPU backends are.
"""

from __future__ import annotations

import pytest
from driver import Engine, seed_of
from flows import drain, prefill, start_decode, until_received

from hybrid_transfer.integrations.vllm.scheduler import state_block_index
from hybrid_transfer.verify import RequestLayout


def _layout(d: Engine, rid: str, num_tokens: int, first_token: int = 0) -> RequestLayout:
    """A decode request's blocks as a read fills them: its attention blocks for the tokens, and the one state
    block align mode keeps the state after ``num_tokens`` in (the test's own arithmetic)."""
    vllm_ids = d.scheduler.kv_cache_manager.get_block_ids(rid)
    ours = d.group_map.to_ours(d.kv_cache_config.select_transfer_block_ids(vllm_ids))
    at = state_block_index("align", num_tokens, d.block_size)
    return RequestLayout(tuple(tuple(ids[: -(-num_tokens // d.block_size)]) if attn else (ids[at],)
                               for attn, ids in zip(d.group_map.attention_mask, ours, strict=True)),
                         num_tokens, first_token)


@pytest.mark.parametrize(("p_block", "d_block", "hit_blocks"), [(64, 32, 3), (32, 64, 1), (32, 32, 2)],
                         ids=["decode-blocks-half", "decode-blocks-double", "equal-blocks"])
def test_a_decode_hit_reads_only_past_it_across_block_sizes(model_dir, hosts, p_block, d_block, hit_blocks):
    p = Engine("P", model_dir, [hosts["prefill"]], tp_size=1, block_size=p_block, kv_role="kv_producer",
               is_prefill=True)
    d = Engine("D", model_dir, [hosts["decode"]], tp_size=1, block_size=d_block, kv_role="kv_consumer",
               is_prefill=False, prefix_caching=True, num_blocks=96)
    hit = hit_blocks * d_block
    n1, n2 = hit + 1, hit + 1 + 45  # turn 1: N-1 on a decode boundary; turn 2 extends it past a block
    try:
        params = prefill(p, "p-1", n1)
        start_decode(d, "d-1", n1, params)
        until_received(d, p, "d-1")
        one = _layout(d, "d-1", n1 - 1)
        d.call("check", [(one, seed_of("p-1"))], True)
        drain((p, d))  # turn 1 ends; vLLM keeps its full blocks, the state block at the hit among them, cached

        params = prefill(p, "p-2", n2)
        request = start_decode(d, "d-2", n2, params)
        # vLLM found the local hit (turn 1's blocks and the state there) and the connector loads the rest.
        assert request.num_computed_tokens == n2 - 1 and d.connector._scheduler.counts["loads_after_hit"] == 1
        two = _layout(d, "d-2", n2 - 1, first_token=hit)
        assert two.block_ids[0][:hit_blocks] == one.block_ids[0][:hit_blocks]  # shared, cached blocks
        until_received(d, p, "d-2")
        # Turn 1's tokens still in the hit's blocks, turn 2's past them and its state: one image, every byte.
        d.call("check", [(one, seed_of("p-1")), (two, seed_of("p-2"))], True)
        drain((p, d))
    finally:
        p.shutdown()
        d.shutdown()

