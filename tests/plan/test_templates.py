"""Per-source templates: head assignment and state intersections, for every TP pair."""

from __future__ import annotations

import pytest

from hybrid_transfer.errors import TopologyError
from hybrid_transfer.layout import CacheOptions, ConvLayout, KVLayout, RankGeometry, load_preset
from hybrid_transfer.plan.templates import assign_kv_heads, kv_template, state_template
from hybrid_transfer.plan.topology import Topology

MODEL = load_preset("qwen3.5-397b-a17b")  # K = 2, nk = 16, nv = 64, w - 1 = 3
TPS = (1, 2, 4, 8)


def geos(p, d, rank, options=None):
    local = RankGeometry(MODEL, d, rank, options)
    sources = {s: RankGeometry(MODEL, p, s, options) for s in Topology(p, d, rank).sources}
    return local, sources


def test_replicated_fan_in_reads_kv_from_the_first_holder_of_each_head():
    local, sources = geos(4, 1, 0)
    assert assign_kv_heads(local, sources) == {0: [(0, 0)], 1: [], 2: [(1, 0)], 3: []}


def test_fan_out_into_replicated_heads_reads_the_holding_slot():
    local, sources = geos(1, 8, 5, CacheOptions(kv_layout=KVLayout.SPLIT))  # rank 5 of 8: head 1, source slot 1
    assert assign_kv_heads(local, sources) == {0: [(0, 1)]}
    tpl = kv_template(local, sources[0], [(0, 1)])
    assert tpl.half.tolist() == [0, 1]
    assert tpl.remote_const.tolist() == [1 * 2096 * 512, 2096 * 1024 + 1 * 2096 * 512]
    assert tpl.local_const.tolist() == [0, 528 * 512]


def test_interleaved_template_has_one_row_per_slot_holding_k_and_v():
    local, sources = geos(1, 8, 5)
    tpl = kv_template(local, sources[0], [(0, 1)])
    assert tpl.half.tolist() == [0]
    assert tpl.remote_const.tolist() == [1 * 2096 * 1024]  # head 1 after head 0's 2096 tokens of K|V
    assert tpl.local_const.tolist() == [0]


def test_a_head_no_source_holds_is_a_topology_error():
    local = RankGeometry(MODEL, 2, 1)
    with pytest.raises(TopologyError):
        assign_kv_heads(local, {0: RankGeometry(MODEL, 2, 0)})


@pytest.mark.parametrize("p", TPS)
@pytest.mark.parametrize("d", TPS)
def test_state_templates_tile_the_local_state_page_exactly(p, d):
    for rank in range(d):
        local, sources = geos(p, d, rank)
        spans = sorted((int(o), int(o + n)) for s in sources.values()
                       for o, n in zip(state_template(local, s).local_off, state_template(local, s).length,
                                       strict=True))
        assert spans[0][0] == 0 and spans[-1][1] == local.state_page_bytes
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


@pytest.mark.parametrize("layout,rows", [(ConvLayout.DS, 4), (ConvLayout.SD, 3 * 3 + 1)])
def test_conv_layout_decides_pieces_per_segment(layout, rows):
    """DS: one piece per Q/K/V segment; SD: one per segment and window row (w - 1 = 3)."""
    options = CacheOptions(conv_layout=layout)
    local, sources = geos(2, 8, 3, options)
    tpl = state_template(local, sources[0])
    assert tpl.length.shape[0] == rows
    assert int(tpl.length.sum()) == local.state_page_bytes
