"""The consumer's PeerRecords (engine/peer_record.py, kept in engine/peers.py) are bounded (issue 19 Deliver 3).

A restarted producer engine is a new incarnation, so a new link and new agents; the old incarnation's link,
once no request needs it, goes with its records. Real producers and a real consumer (NIXL with UCX, ZeroMQ
on loopback) in this one process, polled in turn.
"""

from __future__ import annotations

from test_links import LAYOUT, LOCAL, OTHER_LOCAL, _consumer, _producer, _read, _wait

from hybrid_transfer.engine import EngineConfig, ReadState
from hybrid_transfer.verify import fill_source

INCARNATIONS = 6


def test_records_stay_bounded_across_many_incarnations_of_one_producer_engine():
    """Each restart used to leave its link and its agent's PeerRecord behind for good."""
    with _consumer(EngineConfig()) as c:
        locals_ = (LOCAL, OTHER_LOCAL)
        earlier = []
        for incarnation in range(INCARNATIONS):
            with _producer(engine_id="pa", incarnation=incarnation) as a:
                fill_source(a.cache, LAYOUT, incarnation + 1)
                local = locals_[incarnation % 2]
                _read(c, [a], a.hold(f"r{incarnation}", LAYOUT.block_ids, 20), local, incarnation + 1, earlier)
                earlier = [(local, incarnation + 1)]
                c.poll()  # the older incarnation's idle link goes
                assert c.num_links == 1 and c.num_peer_records == 1
        assert c.link_stats.replaced == INCARNATIONS - 1
        assert c.link_stats.records_dropped == INCARNATIONS - 1


def test_an_older_incarnations_link_and_record_stay_while_a_request_needs_them():
    with _consumer(EngineConfig()) as c, _producer(engine_id="pa", incarnation=1) as old:
        fill_source(old.cache, LAYOUT, 1)
        _read(c, [old], old.hold("r0", LAYOUT.block_ids, 20), LOCAL, 1)
        c.start_read(old.hold("r1", LAYOUT.block_ids, 20), OTHER_LOCAL.block_ids)  # old is not polled: r1 waits
        with _producer(engine_id="pa", incarnation=2) as new:
            fill_source(new.cache, LAYOUT, 2)
            c.start_read(new.hold("r2", LAYOUT.block_ids, 20), LOCAL.block_ids)
            assert _wait(c, [new], "r2").state is ReadState.DONE
            c.poll()
            assert c.is_active("r1") and c.num_links == 2 and c.num_peer_records == 2
            assert c.link_stats.replaced == 0
            assert _wait(c, [old], "r1").state is ReadState.DONE  # r1 reported: the old link is idle
            c.poll()
            assert c.num_links == 1 and c.num_peer_records == 1 and c.link_stats.replaced == 1


def test_a_disconnect_of_an_agent_no_link_holds_adds_no_record():
    """A NIXL disconnect of an agent whose link was dropped used to add a record for it, outside any bound."""
    with _consumer(EngineConfig()) as c:
        c._lose("stranger-agent", RuntimeError("disconnected"))  # what a failed notify or READ calls
        assert c.num_peer_records == 0
