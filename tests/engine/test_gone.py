"""GoneAgents: consumer agents NIXL reported disconnected, remembered for one lease in bounded memory."""

from __future__ import annotations

from hybrid_transfer.engine.lifecycle.gone import GoneAgents
from hybrid_transfer.engine.peer_record import PeerRecord


def test_gone_agents_are_remembered_for_one_lease_and_the_oldest_go_first():
    now = [0.0]
    gone = GoneAgents(lambda: now[0], lease_s=10.0, capacity=2)
    records = [PeerRecord(f"c{i}") for i in range(3)]
    gone.add(records[0])
    now[0] = 1.0
    gone.add(records[1])
    assert gone.get("c0") is records[0] and "c1" in gone and "c9" not in gone
    gone.add(records[2])  # full: c0 goes
    assert "c0" not in gone and len(gone) == 2 and gone.num_evicted == 1
    now[0] = 10.5  # c1's lease (from 1.0) still runs, nothing of c0's could
    assert gone.get("c1") is records[1]
    now[0] = 11.0
    assert "c1" not in gone and "c2" not in gone and len(gone) == 0


def test_an_agent_welcomed_again_is_no_longer_gone():
    gone = GoneAgents(lambda: 0.0, lease_s=10.0, capacity=4)
    gone.add(PeerRecord("c0"))
    gone.discard("c0")
    gone.discard("never")
    assert "c0" not in gone and len(gone) == 0
