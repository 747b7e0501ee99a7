"""Layer-to-tensor map (docs/layout.md#the-layer-to-tensor-map): groups by stride, layer j of every group on tensor j."""

from __future__ import annotations

import pytest

from hybrid_transfer.errors import UnsupportedError
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


def test_uneven_groups_are_refused(tiny_config):
    tiny_config.pop("full_attention_interval")
    tiny_config["layer_types"] = ["full_attention"] * 3 + ["linear_attention"] * 5
    with pytest.raises(UnsupportedError, match="5 linear_attention layers"):
        build_tensor_map(model_from_config(tiny_config))
