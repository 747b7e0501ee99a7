"""``naive`` is vLLM 0.33.0's own descriptor scheme: counted on vLLM's real NIXL pull worker, per READ.

vLLM's side: ``naive_helpers.VllmPull`` runs vLLM's ``NixlPullConnectorWorker`` over caches from
vLLM's ``allocate_kv_cache`` with a recording NIXL fake, and returns what each posted READ holds.
Every test runs with float32 and with bfloat16 SSM state (``ssm_dtype``): the state page, the block
size vLLM aligns to it and the descriptor lengths differ, and vLLM's ``auto`` would pick one by the
host's ISA. Both sides of a comparison are configured with the same dtype. Run in the vLLM environment:

  PYTHONPATH=$PWD VLLM_TARGET_DEVICE=cpu VLLM_SSM_CONV_STATE_LAYOUT=DS HF_HUB_OFFLINE=1 \\
      $(bash scripts/vllm_env.sh)/bin/python -m pytest -q tests/vllm/test_naive_counts.py
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

# "vllm.config", not "vllm": without vLLM installed, "vllm" resolves to this tests/vllm directory.
pytest.importorskip("vllm.config", reason="vLLM tests run in the vLLM environment: see scripts/vllm_env.sh")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import naive_helpers as nh  # noqa: E402

# (model, blocks per engine): enough for the longest request plus its state blocks.
MODELS = {nh.TINY: 160, nh.QWEN35_08B: 12}
# Request sizes around a block: the model's TP1 block, which vLLM aligns to the state page, so it follows
# the SSM dtype (qwen3.5-0.8b: 544 tokens with float32 state, 288 with bfloat16; tiny: forced to 16).
SHORT, PAST = "block-1", "block+1"  # one token short of a block, one token past it
TOKENS = {
    nh.TINY: (1, 16, 39, 255),  # one token, one full block, a partial last block, many blocks
    nh.QWEN35_08B: (1, SHORT, PAST, 2047),  # 2047: issue 11
}
TP_PAIRS = ((1, 1), (2, 1), (1, 2))
CASES = [(m, p, d, n) for m in MODELS for p, d in TP_PAIRS for n in TOKENS[m]]


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def ssm_dtype(request) -> str:
    """The SSM state dtype of every engine of a test (the module's tests run once per dtype)."""
    return request.param


@pytest.fixture(scope="module")
def engines(ssm_dtype):
    """Engines by (model, TP size), built once per SSM dtype: vLLM's config and planning code are the slow part."""
    cache = {}

    def get(model: str, tp: int, **kwargs) -> nh.Engine:
        key = (model, tp, tuple(sorted(kwargs.items())))
        if key not in cache:
            engine = nh.build_engine(model, tp, MODELS[model], ssm_dtype=ssm_dtype, **kwargs)
            assert nh.live_ssm_dtypes(engine.kv_cache_config) == {ssm_dtype}  # what vLLM resolved
            cache[key] = engine
        return cache[key]

    return get


@pytest.fixture(scope="module")
def pulls(engines):
    """vLLM pull workers by (model, P, D, decode rank), handshaken once and reused across requests."""
    cache = {}

    def get(model: str, p: int, d: int, rank: int) -> nh.VllmPull:
        key = (model, p, d, rank)
        if key not in cache:
            cache[key] = nh.VllmPull(engines(model, p), engines(model, d), rank)
        return cache[key]

    return get


def resolve(engines, model: str, tokens: int | str) -> int:
    """A request size of TOKENS in tokens, SHORT and PAST against the model's TP1 block of this SSM dtype."""
    if isinstance(tokens, int):
        return tokens
    block = engines(model, 1).block_size
    return {SHORT: block - 1, PAST: block + 1}[tokens]


def formula(engine: nh.Engine, num_tokens: int) -> int:
    """R * K_fa + G_gdn * R * 4 from vLLM's own groups: R slots, K_fa kernel pages, 4 = conv Q, K, V + ssm."""
    groups = engine.kv_cache_config.kv_cache_groups
    attn = [g for g, a in zip(groups, nh.group_is_attention(engine.kv_cache_config), strict=True) if a]
    slots = len(attn[0].layer_names)
    if any(len(g.layer_names) != slots for g in groups):
        raise AssertionError("vLLM's groups differ in size; the formula assumes equal groups")
    ratio = 1  # FlashAttention-like kernels take the logical block as it is
    pages = math.ceil(num_tokens / engine.block_size) * ratio
    return slots * pages + (len(groups) - len(attn)) * slots * 4


@pytest.mark.parametrize(("model", "p", "d", "tokens"), CASES)
def test_vllm_posts_one_read_per_source_with_the_documented_count(pulls, engines, model, p, d, tokens):
    tokens = resolve(engines, model, tokens)
    for rank in range(d):
        reads = pulls(model, p, d, rank).read(tokens)
        # fan-in (P > D): sources rank*P/D .. (rank+1)*P/D - 1; fan-out: the one source rank*P // D
        expected_sources = list(range(rank * p // d, (rank + 1) * p // d)) if p >= d else [rank * p // d]
        assert [r.source_rank for r in reads] == expected_sources
        for read in reads:
            assert read.descriptors == formula(engines(model, p), tokens), (model, p, d, tokens, rank)


@pytest.mark.parametrize(("tokens", "descriptors"), [(39, 30), (255, 56)])
def test_tiny_model_figures_from_the_contract_notes(pulls, tokens, descriptors):
    """The tiny-model counts first observed by hand on vLLM's worker (TP1 -> TP1) still hold."""
    assert [r.descriptors for r in pulls(nh.TINY, 1, 1, 0).read(tokens)] == [descriptors]


def test_vllm_refuses_a_prefill_block_larger_than_the_decode_block_and_naive_plans_it(engines):
    """vLLM has no path when the prefill block does not divide the decode block (here 32 -> 16 tokens).

    Our naive keeps its rule there: whole source pages, one descriptor per (slot, source page,
    destination page it lands in, head), so 39 tokens (two 32-token pages into three 16-token ones,
    2 KV heads, 2 slots) take 2 * 3 * 2 attention descriptors, plus 4 per GDN layer.
    """
    small, large = engines(nh.TINY, 1), engines(nh.TINY, 1, block_size=32)
    assert (small.block_size, large.block_size) == (16, 32)
    with pytest.raises(AssertionError, match="not divisible"):
        nh.VllmPull(large, small).read(39)
    [ours] = nh.our_naive_reads(nh.TINY, large, small, 39)
    assert ours.descriptors == 2 * 3 * 2 + 6 * 4


# Beyond the three TP pairs: more ranks than KV heads on either side (tiny: 2 KV heads), where vLLM
# reads attention only from the prefill ranks holding distinct heads.
WIDE_CASES = [(nh.TINY, 4, 1, 39), (nh.TINY, 1, 4, 39)]


def _assert_same_reads(pull: nh.VllmPull, model: str, tokens: int, rank: int) -> None:
    theirs = [(r.source_rank, r.descriptors, r.nbytes) for r in pull.read(tokens)]
    ours = [(r.source_rank, r.descriptors, r.nbytes)
            for r in nh.our_naive_reads(model, pull.prefill, pull.decode, tokens, rank, pull.kernel_sizes)]
    assert ours == theirs, (model, tokens, rank)


@pytest.mark.parametrize(("model", "p", "d", "tokens"), CASES + WIDE_CASES)
def test_our_naive_posts_what_vllm_posts(pulls, engines, model, p, d, tokens):
    """Per decode rank: the same source ranks, per source the same descriptors and the same bytes.

    Bytes: both move whole attention pages, the unused tail of the last one included.
    """
    tokens = resolve(engines, model, tokens)
    for rank in range(d):
        _assert_same_reads(pulls(model, p, d, rank), model, tokens, rank)


@pytest.mark.parametrize(("model", "tokens"), [(nh.TINY, 39), (nh.TINY, 255), (nh.QWEN35_08B, PAST)])
def test_a_fixed_kernel_block_smaller_than_the_logical_block(engines, model, tokens):
    """A 16-token kernel under a larger logical block: both move every kernel page of the logical blocks."""
    engine = engines(model, 1, block_size=32, backend=nh.kernel_backend(fixed=16))
    pull = nh.VllmPull(engine, engine)
    assert pull.consumer._physical_blocks_per_logical_kv_block == engine.block_size // 16 > 1
    _assert_same_reads(pull, model, resolve(engines, model, tokens), 0)


@pytest.mark.parametrize("tokens", [39, 255])
def test_a_larger_decode_block_costs_naive_one_descriptor_per_head(engines, tokens):
    """Prefill block 16 -> decode block 32 (tiny, TP1): same bytes, one descriptor per (page, head) for us.

    vLLM reads each 16-token source page whole into half of a 32-token page and reorders the received
    pages afterwards on the device (``post_process_device_kv_on_receive``). Our naive writes each byte
    where it belongs, and in ``[heads][tokens][K|V]`` a source page's heads are not adjacent in the
    larger destination page, so its attention descriptors are vLLM's times the KV heads per rank.
    """
    small, large = engines(nh.TINY, 1), engines(nh.TINY, 1, block_size=32)
    pull = nh.VllmPull(small, large)
    [theirs] = pull.read(tokens)
    [ours] = nh.our_naive_reads(nh.TINY, small, large, tokens, 0, pull.kernel_sizes)
    assert ours.nbytes == theirs.nbytes
    groups = large.kv_cache_config.kv_cache_groups
    is_attn = nh.group_is_attention(large.kv_cache_config)
    slots = len(groups[0].layer_names)
    state = sum(not a for a in is_attn) * slots * 4
    heads = large.vllm_config.model_config.get_num_kv_heads(large.vllm_config.parallel_config)
    assert heads > 1
    assert ours.descriptors - state == (theirs.descriptors - state) * heads
