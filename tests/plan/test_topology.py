"""Sources and notifications per docs/lifecycle.md#who-notifies-whom."""

from __future__ import annotations

import pytest

from hybrid_transfer.errors import TopologyError
from hybrid_transfer.plan.topology import Topology
from hybrid_transfer.plan.types import Notification


@pytest.mark.parametrize("p,d", [(1, 1), (1, 8), (2, 8), (4, 4), (2, 4)])
def test_fan_out_reads_one_source_that_expects_d_over_p(p, d):
    for rank in range(d):
        t = Topology(p, d, rank)
        assert t.sources == (rank // (d // p),)
        assert t.notify == (Notification(rank // (d // p), d // p),)


@pytest.mark.parametrize("p,d", [(8, 1), (8, 2), (4, 2), (2, 1)])
def test_fan_in_notifies_every_source_of_its_slice_with_one(p, d):
    a = p // d
    for rank in range(d):
        t = Topology(p, d, rank)
        assert t.sources == tuple(range(rank * a, rank * a + a))
        assert [n.expected_consumers for n in t.notify] == [1] * a


def test_every_producer_rank_hears_from_exactly_the_consumers_it_expects():
    for p in (1, 2, 4, 8):
        for d in (1, 2, 4, 8):
            heard: dict[int, list[int]] = {}
            expects: dict[int, set[int]] = {}
            for rank in range(d):
                for n in Topology(p, d, rank).notify:
                    heard.setdefault(n.source_rank, []).append(rank)
                    expects.setdefault(n.source_rank, set()).add(n.expected_consumers)
            assert sorted(heard) == list(range(p))
            for src, consumers in heard.items():
                assert expects[src] == {len(consumers)}


@pytest.mark.parametrize("p,d,rank", [(3, 2, 0), (2, 3, 0), (2, 4, 4), (2, 4, -1), (0, 1, 0)])
def test_unmappable_topology_raises(p, d, rank):
    with pytest.raises(TopologyError) as info:
        Topology(p, d, rank)
    assert info.value.prefill_tp == p and info.value.decode_tp == d
