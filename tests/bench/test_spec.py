"""BenchSpec: validation names the bad field; points, variants and GPU placement follow the flags."""

from __future__ import annotations

import pytest

from hybrid_transfer.bench.spec import BenchSpec, Point, Sweep, Variant
from hybrid_transfer.errors import ConfigError, UnknownPresetError
from hybrid_transfer.plan.types import PlanMode


def test_defaults_are_a_small_valid_run():
    spec = BenchSpec().validate()
    assert spec.preset == "qwen3.5-0.8b" and spec.prefill_tp == spec.decode_tp == 1
    assert spec.points == (Point(2048, 0.0),)


@pytest.mark.parametrize("changes, field", [
    ({"prefill_tp": 0}, "prefill_tp"),
    ({"prefill_tp": 2, "decode_tp": 3}, "decode_tp"),
    ({"requests": 0}, "requests"),
    ({"concurrency": 0}, "concurrency"),
    ({"tokens": -1}, "tokens"),
    ({"fragmentation": 1.5}, "fragmentation"),
    ({"warmup": -1}, "warmup"),
    ({"rounds": 0}, "rounds"),
    ({"kv_dtype": "int4"}, "kv_dtype"),
    ({"kv_layout": "HND"}, "kv_layout"),
    ({"decode_gpus": ()}, "decode_gpus"),
    ({"prefill_gpus": (-1,)}, "prefill_gpus"),
    ({"sweep_values": (0.5,)}, "sweep_values"),
    ({"sweep": Sweep.TOKENS, "sweep_values": (1.5,)}, "sweep_values"),
    ({"sweep": Sweep.FRAGMENTATION, "sweep_values": (2.0,)}, "sweep_values"),
    ({"per_step": 0}, "per_step"),
    ({"concurrency": 4, "per_step": 5}, "per_step"),
    ({"read_batching": "per_token"}, "read_batching"),
])
def test_validate_names_the_bad_field(changes, field):
    with pytest.raises(ConfigError) as info:
        BenchSpec(**changes).validate()
    assert info.value.field == field


def test_unknown_preset_lists_the_shipped_ones():
    with pytest.raises(UnknownPresetError) as info:
        BenchSpec(preset="llama").validate()
    assert "qwen3.5-0.8b" in info.value.known


def test_variants_always_include_naive_and_ceiling_once_and_coalesced_beside_pack_and_auto():
    assert BenchSpec().variants == (Variant.COALESCED, Variant.NAIVE, Variant.CEILING, Variant.COPY)
    assert BenchSpec(mode=PlanMode.NAIVE).variants == (Variant.NAIVE, Variant.CEILING, Variant.COPY)
    assert BenchSpec(mode=PlanMode.PACK).variants == (Variant.PACK, Variant.COALESCED, Variant.NAIVE, Variant.CEILING,
                                                      Variant.COPY)
    assert BenchSpec(mode=PlanMode.AUTO).variants[:2] == (Variant.AUTO, Variant.COALESCED)
    assert Variant.CEILING.plan_mode is None and Variant.COPY.plan_mode is None and Variant.AUTO.plan_mode is PlanMode.AUTO


def test_sweep_points_vary_one_axis():
    frag = BenchSpec(tokens=512, fragmentation=0.3, sweep=Sweep.FRAGMENTATION, sweep_values=(0.0, 1.0))
    assert frag.points == (Point(512, 0.0), Point(512, 1.0))
    tokens = BenchSpec(fragmentation=0.3, sweep=Sweep.TOKENS, sweep_values=(64.0, 128.0))
    assert tokens.points == (Point(64, 0.3), Point(128, 0.3))
    assert len(BenchSpec(sweep=Sweep.TOKENS).points) == 5  # default values


def test_gpus_are_assigned_round_robin_per_side():
    spec = BenchSpec(prefill_tp=2, decode_tp=8, prefill_gpus=(0,), decode_gpus=(1, 2))
    assert [spec.gpu_of(True, r) for r in range(2)] == [0, 0]
    assert [spec.gpu_of(False, r) for r in range(4)] == [1, 2, 1, 2]


def test_round_order_rotates_so_every_variant_leads_once():
    spec = BenchSpec(rounds=3)
    orders = [spec.round_order(r) for r in range(3)]
    assert [o[0] for o in orders] == [Variant.COALESCED, Variant.NAIVE, Variant.CEILING]
    assert all(sorted(o, key=lambda v: v.value) == sorted(spec.variants, key=lambda v: v.value) for o in orders)


def test_a_step_starts_concurrency_requests_unless_per_step_says_fewer():
    assert BenchSpec(concurrency=16).step_size == 16
    assert BenchSpec(concurrency=16, per_step=4).validate().step_size == 4
