"""Property tests: every topology, block size pair and mode moves exactly the right bytes.

Each example builds a small hybrid (or attention-only) model, a prefill engine and a decode
engine of real CPU caches, fills every prefill rank from global coordinates (hybrid_transfer.verify),
poisons every decode rank, plans and executes each decode rank's reads over plain memory, and
checks every byte of every decode cache: valid tokens and state hold the pattern, everything
else (tails, padding, extra blocks, other blocks) still holds the poison. Naive plans move whole
attention pages like vLLM, so only for them the unused tail of the last page is not checked.
"""

from __future__ import annotations

import math

import msgspec
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from hybrid_transfer.cache import HybridCache
from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import (
    CacheOptions,
    ConvLayout,
    DType,
    KVLayout,
    LayerKind,
    RankGeometry,
    SsmOrder,
    model_from_config,
)
from hybrid_transfer.plan.executor import execute
from hybrid_transfer.plan.planner import Planner
from hybrid_transfer.plan.types import PackSourcePlan, PlanMode
from hybrid_transfer.planner_input import describe_cache, memory_space
from hybrid_transfer.verify import check_destination, fill_source, make_request, poison

TP = st.sampled_from([1, 2, 4, 8])


@st.composite
def models(draw, max_tp: int):
    """Preset-shaped configs with tiny dims; GDN head counts divisible by every drawn TP size."""
    kind = draw(st.sampled_from(["interval4", "interval4", "interval3", "interval2", "attention_only"]))
    cfg = {
        "num_key_value_heads": draw(st.sampled_from([1, 2, 4])),
        "head_dim": draw(st.sampled_from([2, 4, 8])),
        "dtype": draw(st.sampled_from(["bfloat16", "float16"])),
    }
    if kind == "attention_only":
        n = draw(st.integers(1, 3))
        cfg.update(num_hidden_layers=n, layer_types=["full_attention"] * n)
    else:
        interval = int(kind[-1])
        cfg.update(num_hidden_layers=interval * draw(st.integers(1, 2)), full_attention_interval=interval)
        nk = max_tp * draw(st.sampled_from([1, 2]))
        cfg.update(
            linear_num_key_heads=nk,
            linear_num_value_heads=nk * draw(st.sampled_from([1, 2])),
            linear_key_head_dim=draw(st.sampled_from([2, 4])),
            linear_value_head_dim=draw(st.sampled_from([2, 4])),
            linear_conv_kernel_dim=draw(st.sampled_from([2, 3, 4])),
        )
        ssm = draw(st.sampled_from(["float32", "bfloat16", None]))
        if ssm:
            cfg["mamba_ssm_dtype"] = ssm
    return model_from_config(cfg, name=f"prop-{kind}")


@st.composite
def mtp_models(draw, max_tp: int):
    """``models``, or a GDN model with an irregular layer pattern (uneven kinds: padded groups even without drafts)."""
    if draw(st.booleans()):
        return draw(models(max_tp))
    base = draw(models(max_tp).filter(lambda m: bool(m.gdn_layers)))
    pattern = draw(st.lists(st.sampled_from(["full_attention", "linear_attention"]), min_size=2, max_size=9)
                   .filter(lambda ks: len(set(ks)) == 2))
    cfg = {f: getattr(base, f) for f in ("head_dim", "linear_num_key_heads", "linear_num_value_heads",
                                         "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
    cfg.update(num_hidden_layers=len(pattern), layer_types=pattern, num_key_value_heads=base.num_kv_heads,
               dtype=base.dtype.value, mamba_ssm_dtype=base.ssm_dtype.value)
    return model_from_config(cfg, name="prop-irregular")


@st.composite
def side_options(draw, model, tp, shared):
    """Block and kernel block sizes of one side; None derives the block size by page-size unification."""
    if draw(st.booleans()):
        return CacheOptions(alignment=draw(st.sampled_from([1, 2, 4, 16])), **shared)
    kernel = draw(st.sampled_from([1, 2, 3, 4, 8]))
    ratio = draw(st.sampled_from([1, 2, 3]))
    # The page must hold the state: scale the block up in whole kernel blocks until it does.
    g = RankGeometry(model, tp, 0, CacheOptions(alignment=1, **shared))
    min_tokens = math.ceil(g.state_page_bytes / g.kv_bytes_per_token) if model.gdn_layers else 1
    blocks = max(ratio, math.ceil(min_tokens / kernel))
    return CacheOptions(block_size=kernel * blocks, kernel_block_size=kernel, **shared)


@st.composite
def scenarios(draw, mtp: bool = False):
    """``mtp``: draft (MTP) attention layers and speculative conv slots too, and irregular layer patterns,
    so that padded groups (docs/layout.md#padded-groups) are common."""
    p, d = draw(TP), draw(TP)
    model = draw(mtp_models(max(p, d)) if mtp else models(max(p, d)))
    shared = {
        "kv_dtype": draw(st.sampled_from([None, None, DType.FP8])),
        "conv_layout": draw(st.sampled_from([ConvLayout.DS, ConvLayout.DS, ConvLayout.SD])),
        "ssm_order": draw(st.sampled_from(list(SsmOrder))),
        "kv_layout": draw(st.sampled_from(list(KVLayout))),
    }
    if mtp:
        shared["draft_layers"] = draw(st.integers(0, 3))
        shared["speculative_slots"] = draw(st.integers(0, 3))
    # An opaque page interior (vLLM's CPU kernels) moves partial kernel pages whole; both sides then
    # need one kernel block size (the planner refuses others, tested in test_page_interior.py).
    opaque = draw(st.booleans())
    if opaque:
        shared["kv_interior"] = "CPU_ATTN:vec"
    prefill = draw(side_options(model, p, shared))
    decode = draw(side_options(model, d, shared))
    if opaque:
        try:
            kernel = RankGeometry(model, p, 0, prefill).kernel_block_size
        except ConfigError:
            assume(False)
        g = RankGeometry(model, d, 0, CacheOptions(alignment=1, **shared))
        min_tokens = math.ceil(g.state_page_bytes / g.kv_bytes_per_token) if model.gdn_layers else 1
        blocks = max(draw(st.sampled_from([1, 2, 3])), math.ceil(min_tokens / kernel))
        decode = CacheOptions(block_size=kernel * blocks, kernel_block_size=kernel, **shared)
    try:
        bp = RankGeometry(model, p, 0, prefill).block_size
        bd = RankGeometry(model, d, 0, decode).block_size
    except ConfigError:
        assume(False)
    big = max(bp, bd)
    tokens = draw(st.one_of(st.sampled_from([0, 1, bp, bd, bp + 1, bd - 1 or 1]), st.integers(0, 3 * big)))
    return {
        "model": model, "p": p, "d": d, "prefill": prefill, "decode": decode, "tokens": tokens, "shared": shared,
        "mode": draw(st.sampled_from(list(PlanMode))),
        "fragmentation": draw(st.sampled_from([0.0, 0.5, 1.0])),
        "extra_local": draw(st.integers(0, 2)),
        "spare": draw(st.integers(0, 4)),
        "seed": draw(st.integers(0, 2**16)),
    }


def engine(model, tp, options, num_tokens, spare, rng, fragmentation, extra=0):
    geos = [RankGeometry(model, tp, r, options) for r in range(tp)]
    needed = sum(len(ids) for ids in make_request(geos[0], num_tokens, 10**6, 0, 0.0, extra).block_ids)
    num_blocks = 2 * needed + spare + 1
    request = make_request(geos[0], num_tokens, num_blocks, rng, fragmentation, extra)
    caches = [HybridCache.allocate(g, num_blocks) for g in geos]
    descs = [describe_cache(c) for c in caches]
    return caches, descs, request


def _attention_kernel_pages(cache: HybridCache, block_ids, addr, length):
    """Kernel page index (tensor, block, kernel block) of a row's first and last byte, or None for a state row."""
    g = cache.geometry
    attn = {b for grp, ids in zip(g.tensor_map.groups, block_ids, strict=True) if grp.kind is LayerKind.ATTENTION
            for b in ids}
    for t, region in enumerate(cache.regions):
        if region.addr <= addr < region.addr + region.length:
            first, last = addr - region.addr, addr - region.addr + length - 1
            if first // g.page_bytes not in attn:
                return None
            return (t, first // g.kernel_block_bytes), (t, last // g.kernel_block_bytes)
    raise AssertionError(f"row at {addr:#x} is in no region")


def assert_page_granular(plan, local_cache, local_req, remote_caches, remote_req):
    """vLLM's rule: no naive descriptor crosses a kernel page on either side."""
    for src in plan.sources:
        rows = zip(src.local_addr.tolist(), src.remote_addr.tolist(), src.length.tolist(), strict=True)
        for la, ra, n in rows:
            here = _attention_kernel_pages(local_cache, local_req.block_ids, la, n)
            there = _attention_kernel_pages(remote_caches[src.source_rank], remote_req.block_ids, ra, n)
            assert (here is None) == (there is None)
            if here is not None:
                assert here[0] == here[1] and there[0] == there[1], (la, ra, n)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios())
def test_every_plan_moves_exactly_the_right_bytes(s):
    check_every_plan(s)


def check_every_plan(s):
    """Plan, execute and check every decode rank of one scenario, and who notifies whom."""
    rng = np.random.default_rng(s["seed"])
    model, n = s["model"], s["tokens"]
    pre, pre_descs, pre_req = engine(model, s["p"], s["prefill"], n, s["spare"], rng, s["fragmentation"])
    dec, dec_descs, dec_req = engine(model, s["d"], s["decode"], n, s["spare"], rng, s["fragmentation"],
                                     s["extra_local"])
    for cache in pre:
        poison(cache)
        fill_source(cache, pre_req, s["seed"])
    remotes = {r: memory_space(c, f"prefill {r}") for r, c in enumerate(pre)}
    heard: dict[int, list[tuple[int, int]]] = {}
    for rank, cache in enumerate(dec):
        poison(cache)
        planner = Planner(model, dec_descs[rank], pre_descs)
        plan = planner.plan(dec_req.block_ids, pre_req.block_ids, n, s["mode"])
        assert plan.total_bytes == plan.expected_bytes
        naive = s["mode"] is PlanMode.NAIVE
        if not naive and "kv_interior" not in s["shared"]:
            assert plan.expected_bytes == planner.expected_bytes(n)  # valid bytes only
        elif not naive:  # whole kernel pages: tokens up to the end of the last page holding one
            kbs = dec[rank].geometry.kernel_block_size
            per_token = dec[rank].geometry.kv_bytes_per_token * dec[rank].geometry.num_attention_layers
            state = planner.expected_bytes(n) - n * per_token
            assert plan.expected_bytes == -(-n // kbs) * kbs * per_token + state
        execute(plan, memory_space(cache, f"decode {rank}"), remotes)
        check_destination(cache, dec_req, s["seed"], skip_attention_tails=naive)
        if naive:
            assert_page_granular(plan, cache, dec_req, pre, pre_req)
        if s["mode"] is PlanMode.PACK:
            for src in plan.sources:
                assert isinstance(src, PackSourcePlan) and 1 <= src.num_descriptors <= 2
        for note in plan.notify:
            heard.setdefault(note.source_rank, []).append((rank, note.expected_consumers))
    # Every producer rank hears from exactly as many distinct consumers as each of them tells it to expect.
    assert sorted(heard) == list(range(s["p"]))
    for notes in heard.values():
        assert len({r for r, _ in notes}) == len(notes)
        assert {e for _, e in notes} == {len(notes)}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios(mtp=True))
def test_draft_layers_and_padded_groups_move_exactly_the_right_bytes(s):
    """As above with MTP's cache: draft attention layers after the model's, conv windows widened by the
    speculative slots, groups padded as vLLM pads them. A padded group's pages on tensors where it has no
    layer hold a pattern on the prefill side (verify.fill_source) and must stay poison on the decode side."""
    check_every_plan(s)
    draft = s["shared"]["draft_layers"]
    g = RankGeometry(s["model"], s["d"], 0, s["decode"])
    assert g.tensor_map.num_cached_layers == s["model"].num_layers + draft
    assert g.num_attention_layers == len(s["model"].attention_layers) + draft


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(scenarios(), st.data())
def test_a_prefix_hit_moves_only_the_tokens_past_it_and_the_state(s, data):
    """The decode side holds [0, F) already (a local prefix hit, F on one of its block boundaries): the plan
    writes no byte of those blocks, every byte of [F, n) and the state, and nothing else."""
    assume(s["mode"] is not PlanMode.NAIVE)
    rng = np.random.default_rng(s["seed"])
    model, n = s["model"], s["tokens"]
    pre, pre_descs, pre_req = engine(model, s["p"], s["prefill"], n, s["spare"], rng, s["fragmentation"])
    dec, dec_descs, dec_req = engine(model, s["d"], s["decode"], n, s["spare"], rng, s["fragmentation"],
                                     s["extra_local"])
    block = dec[0].geometry.block_size
    first = block * data.draw(st.integers(0, n // block), label="hit blocks")
    hit = msgspec.structs.replace(dec_req, first_token=first)
    for cache in pre:
        poison(cache)
        fill_source(cache, pre_req, s["seed"])
    remotes = {r: memory_space(c, f"prefill {r}") for r, c in enumerate(pre)}
    for rank, cache in enumerate(dec):
        poison(cache)
        planner = Planner(model, dec_descs[rank], pre_descs)
        plan = planner.plan(dec_req.block_ids, pre_req.block_ids, n, s["mode"], first_token=first)
        assert plan.total_bytes == plan.expected_bytes
        moved = cache.geometry.moved_token_end(n)
        assert plan.expected_bytes == planner.expected_bytes(moved, first)
        if first:
            assert not any(isinstance(src, PackSourcePlan) for src in plan.sources)
        execute(plan, memory_space(cache, f"decode {rank}"), remotes)
        check_destination(cache, hit, s["seed"])
