"""``--allocation vllm-pool`` (bench/vllm_pool.py) against vLLM 0.33's real KVCacheManager: the same trace, the same ids.

A KVCacheConfig of qwen3.5-0.8b from vLLM's own planning code (naive_helpers.build_engine, no prefix
caching), vLLM's KVCacheManager over it, and the bench's churn replayed through both, on a prefill
engine's path (the prompt computed) and a decode engine's (the prompt as external tokens of an async
load): every arrival gets the same block ids per group, and the bench's timed layouts are vLLM's ids
in our group order. Both with float32 and with bfloat16 SSM state: the state page sets vLLM's block
size, so the simulation's geometry is built with the same SSM dtype as vLLM's config.
Run in the vLLM environment:

  PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 \\
      $(bash scripts/vllm_env.sh)/bin/python -m pytest -q tests/vllm/test_vllm_pool_trace.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# "vllm.config", not "vllm": without vLLM installed, "vllm" resolves to this tests/vllm directory.
pytest.importorskip("vllm.config", reason="vLLM tests run in the vLLM environment: see scripts/vllm_env.sh")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import naive_helpers as nh  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes  # noqa: E402
from vllm.v1.kv_cache_interface import MambaSpec  # noqa: E402
from vllm_engine import make_request  # noqa: E402

from hybrid_transfer.bench import vllm_pool  # noqa: E402
from hybrid_transfer.bench.vllm_pool import Arrive  # noqa: E402
from hybrid_transfer.integrations.vllm.groups import engine_groups  # noqa: E402
from hybrid_transfer.layout import CacheOptions, RankGeometry, load_preset  # noqa: E402
from hybrid_transfer.layout.engine_spec import engine_group_order, to_our_group_order  # noqa: E402

PRESET = nh.QWEN35_08B
REQUESTS = 3


def _manager(engine: nh.Engine) -> KVCacheManager:
    """vLLM's KVCacheManager as its Scheduler builds it (block sizes resolved by vLLM), prefix caching off."""
    vc, kvc = engine.vllm_config, engine.kv_cache_config
    scheduler_block_size, hash_block_size = resolve_kv_cache_block_sizes(kvc, vc)
    return KVCacheManager(kvc, max_model_len=vc.model_config.max_model_len, scheduler_block_size=scheduler_block_size,
                          hash_block_size=hash_block_size, enable_caching=False)


def _allocate(manager: KVCacheManager, request, tokens: int, side: str):
    """A prefill engine computes the prompt (allocate_slots for its tokens); a decode engine gets the same
    count as external tokens an async load will write (the scheduler's path for a remote prefill)."""
    if side == "prefill":
        return manager.allocate_slots(request, tokens)
    return manager.allocate_slots(request, 0, num_external_computed_tokens=tokens, delay_cache_blocks=True)


# float32 state: TP 1 544-token blocks (1,500 tokens end in a partial third block), TP 4 272-token blocks;
# bfloat16 state: 288 and 144 (a partial sixth block at TP 1). Every case ends in a partial block.
@pytest.mark.parametrize("ssm_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("side", ["prefill", "decode"])
@pytest.mark.parametrize(("tp", "tokens", "seed"), [(1, 1500, 0), (4, 2048, 5)])
def test_churn_through_vllms_kv_cache_manager_gives_the_simulated_ids(tp, tokens, seed, side, ssm_dtype):
    geo = RankGeometry(load_preset(PRESET), tp, 0, CacheOptions(ssm_dtype=ssm_dtype))
    num_blocks = vllm_pool.bench_pool_blocks(geo, tokens, REQUESTS)
    engine = nh.build_engine(PRESET, tp, num_blocks, ssm_dtype=ssm_dtype)
    kvc = engine.kv_cache_config
    assert nh.live_ssm_dtypes(kvc) == {ssm_dtype}  # what vLLM resolved
    assert kvc.num_blocks == num_blocks
    assert tokens % geo.block_size != 0
    # vLLM's groups, in vLLM's order, are the simulation's: GDN x3, then attention of our block size.
    sizes = tuple(None if isinstance(g.kv_cache_spec, MambaSpec) else g.kv_cache_spec.block_size
                  for g in kvc.kv_cache_groups)
    assert sizes == vllm_pool.group_block_sizes(geo) == (None, None, None, geo.block_size)
    order = engine_group_order(geo.tensor_map, engine_groups(kvc))
    assert tuple(order.index(k) for k in range(len(order))) == vllm_pool.vllm_group_order(geo)

    manager = _manager(engine)
    churn = vllm_pool.Churn(tokens=tokens, timed=REQUESTS, live=vllm_pool.LIVE_PER_TIMED * REQUESTS)
    events = vllm_pool.churn_trace(churn, seed)
    simulated = vllm_pool.replay(events, num_blocks, sizes)
    live = {}
    for ev in events:
        if isinstance(ev, Arrive):
            request = make_request(f"r{ev.request}", ev.tokens)
            assert _allocate(manager, request, ev.tokens, side) is not None, ev
            got = [list(g) for g in manager.get_block_ids(request.request_id)]
            assert got == simulated[ev.request], ev
            live[ev.request] = request
        else:
            manager.free(live.pop(ev.request))
    # The churn reused freed blocks out of order: some request's attention ids do not ascend.
    assert any(ids[-1] != sorted(ids[-1]) for ids in simulated.values())
    # The bench's timed layouts are vLLM's ids of the timed requests, in our group order.
    layouts = vllm_pool.pool_layouts(geo, tokens, REQUESTS, num_blocks, seed)
    assert [lay.block_ids for lay in layouts] == [
        to_our_group_order(manager.get_block_ids(f"r{r}"), order) for r in churn.timed_ids]
