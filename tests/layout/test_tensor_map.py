"""Layer-to-tensor map (docs/layout.md#the-layer-to-tensor-map): groups by stride, layer j of every group on tensor j."""

from __future__ import annotations

import pytest

from hybrid_transfer.errors import ConfigError
from hybrid_transfer.layout import (
    LayerKind,
    RankGeometry,
    build_tensor_map,
    load_preset,
    model_from_config,
    preset_names,
)


def test_397b_puts_layers_4j_to_4j_plus_3_on_tensor_j():
    tmap = build_tensor_map(load_preset("qwen3.5-397b-a17b"))
    assert tmap.num_tensors == 15
    for j in range(15):
        for layer in (4 * j, 4 * j + 1, 4 * j + 2, 4 * j + 3):
            assert tmap.tensor_of(layer) == j
    assert [tmap.tensor_of(i) for i in range(60)] == [i // 4 for i in range(60)]


def test_397b_groups_attention_first_then_gdn_by_stride():
    tmap = build_tensor_map(load_preset("qwen3.5-397b-a17b"))
    assert [g.kind for g in tmap.groups] == [LayerKind.ATTENTION] + [LayerKind.GDN] * 3
    assert tmap.groups[0].layers == tuple(range(3, 60, 4))
    assert tmap.groups[1].layers == tuple(range(0, 60, 4))
    assert tmap.groups[2].layers == tuple(range(1, 60, 4))
    assert tmap.groups[3].layers == tuple(range(2, 60, 4))
    assert tmap.groups_of(LayerKind.ATTENTION) == (0,)
    assert tmap.groups_of(LayerKind.GDN) == (1, 2, 3)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_map_is_consistent(name):
    m = load_preset(name)
    tmap = build_tensor_map(m)
    group_size = min(len(m.attention_layers), len(m.gdn_layers))
    assert tmap.num_tensors == group_size
    seen = []
    for group in tmap.groups:
        assert len(group.layers) == group_size
        assert all(m.layer_kinds[layer] is group.kind for layer in group.layers)
        for j, layer in enumerate(group.layers):
            assert tmap.tensor_of(layer) == j
        seen.extend(group.layers)
    assert sorted(seen) == list(range(m.num_layers))  # every layer in exactly one group
    kinds = [g.kind for g in tmap.groups]
    assert kinds == sorted(kinds, key=lambda k: k is LayerKind.GDN)  # attention groups first
    assert RankGeometry(m, 1).num_tensors == group_size


def test_stride_rule_on_irregular_layer_types(tiny_config):
    # Layers: A at 0 and 5; GDN elsewhere (6 of them) -> 3 GDN groups of 2, taken with stride 3.
    tiny_config.pop("full_attention_interval")
    kinds = ["linear_attention"] * 8
    kinds[0] = kinds[5] = "full_attention"
    tiny_config["layer_types"] = kinds
    tmap = build_tensor_map(model_from_config(tiny_config))
    gdn = [1, 2, 3, 4, 6, 7]
    assert [g.layers for g in tmap.groups] == [(0, 5), tuple(gdn[0::3]), tuple(gdn[1::3]), tuple(gdn[2::3])]
    assert tmap.layer_tensor == (0, 0, 0, 0, 1, 1, 1, 1)


def test_more_attention_than_gdn_layers(tiny_config):
    tiny_config.pop("full_attention_interval")
    tiny_config["layer_types"] = ["full_attention"] * 6 + ["linear_attention"] * 2
    tmap = build_tensor_map(model_from_config(tiny_config))
    assert tmap.num_tensors == 2
    assert [g.layers for g in tmap.groups] == [(0, 3), (1, 4), (2, 5), (6, 7)]


def _vllm_groups(kinds: list[str]) -> list[tuple[str, tuple[int, ...]]]:
    """vLLM 0.33's hybrid grouping, restated from docs/layout.md#padded-groups as a plain loop (the oracle):
    buckets in order of first appearance, group size the smallest bucket (the largest when it is under 1.5 times
    the smallest), ceil(len / size) groups per bucket, group i = layers[i::num_groups]."""
    buckets: dict[str, list[int]] = {}
    for i, k in enumerate(kinds):
        buckets.setdefault(k, []).append(i)
    lo, hi = min(map(len, buckets.values())), max(map(len, buckets.values()))
    size = hi if hi < lo * 1.5 else lo
    out = []
    for kind, layers in buckets.items():
        n = -(-len(layers) // size)
        out.extend((kind, tuple(layers[i::n])) for i in range(n))
    return out


def test_uneven_groups_are_padded_as_vllm_pads_them(tiny_config):
    # 3 attention, 5 GDN: group size 3, GDN in 2 groups [3, 5, 7] and [4, 6]; the second has nothing on tensor 2.
    tiny_config.pop("full_attention_interval")
    tiny_config["layer_types"] = ["full_attention"] * 3 + ["linear_attention"] * 5
    tmap = build_tensor_map(model_from_config(tiny_config))
    assert [g.layers for g in tmap.groups] == [(0, 1, 2), (3, 5, 7), (4, 6)]
    assert tmap.num_tensors == 3 and tmap.is_padded
    assert tmap.group_tensors == (3, 3, 2)
    assert tmap.layer_tensor == (0, 1, 2, 0, 0, 1, 1, 2)


def test_the_tiny_qwen3_next_with_one_mtp_layer_matches_the_measured_vllm_groups(tiny_config):
    # Measured on vLLM: 4 layers (L0-L2 GDN, L3 attention) + mtp.layers.0 -> attn[L3, mtp0], mamba[L0, L2], mamba[L1].
    tiny_config["num_hidden_layers"] = 4
    model = model_from_config(tiny_config)
    tmap = build_tensor_map(model, draft_layers=1)
    assert [(g.kind, g.layers) for g in tmap.groups] == [
        (LayerKind.ATTENTION, (3, 4)), (LayerKind.GDN, (0, 2)), (LayerKind.GDN, (1,))]
    assert tmap.group_tensors == (2, 2, 1)
    assert tmap.layer_tensor == (0, 0, 1, 0, 1)
    assert tmap.cached_layers() == ((0, LayerKind.GDN), (1, LayerKind.GDN), (2, LayerKind.GDN),
                                    (3, LayerKind.ATTENTION), (4, LayerKind.ATTENTION))
    assert model.num_layers == 4  # the model's own layers are unchanged
    assert [g.layers for g in build_tensor_map(model).groups] == [(3,), (0,), (1,), (2,)]


def test_qwen3_next_with_one_mtp_layer_pads_each_gdn_group_by_one_slot():
    # 12 attention + 1 MTP = 13: group size 13; 36 GDN layers in ceil(36/13) = 3 strided groups of 12 each.
    model = load_preset("qwen3-next-80b-a3b")
    tmap = build_tensor_map(model, draft_layers=1)
    assert tmap.num_tensors == 13
    assert tmap.groups[0].layers == (*range(3, 48, 4), 48)
    assert [g.layers for g in tmap.groups[1:]] == [tuple(model.gdn_layers[i::3]) for i in range(3)]
    assert tmap.group_tensors == (13, 12, 12, 12)
    assert tmap.tensor_of(48) == 12


@pytest.mark.parametrize("pattern", [
    "AGGGAGGG", "GGGA", "GAGAGAGA", "AAAAAGG", "AAAGGGGG", "GGGGGGGGGA", "AAG", "GAAAAG", "AGGGGAGGGG"])
@pytest.mark.parametrize("draft", [0, 1, 2, 3])
def test_the_map_is_vllms_grouping_for_any_layer_pattern(tiny_config, pattern, draft):
    tiny_config.pop("full_attention_interval")
    names = {"A": "full_attention", "G": "linear_attention"}
    tiny_config["layer_types"] = [names[c] for c in pattern]
    tiny_config["num_hidden_layers"] = len(pattern)
    tmap = build_tensor_map(model_from_config(tiny_config), draft_layers=draft)
    want = _vllm_groups([names[c] for c in pattern] + ["full_attention"] * draft)
    assert sorted((g.kind.value, g.layers) for g in tmap.groups) == sorted(want)
    for g in tmap.groups:
        assert [tmap.tensor_of(layer) for layer in g.layers] == list(range(len(g.layers)))
    assert tmap.num_tensors == max(len(g) for _, g in want)


def test_draft_layers_must_be_a_non_negative_integer(tiny_model):
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ConfigError, match="draft_layers") as info:
            build_tensor_map(tiny_model, draft_layers=bad)
        assert info.value.field == "draft_layers"
