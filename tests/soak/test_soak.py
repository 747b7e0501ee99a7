"""The shortened soak: a few hundred requests, one SIGKILL and restart of each side, authentication on.

Real NIXL between a spawned prefill and a spawned decode process (hybrid_transfer/soak). Checks what
the full soak checks: every request ended exactly once on each side (or went down with a killed
process), zero wrong bytes, no replayed or edited ticket DONE, nothing pinned, quarantined or alive
in NIXL at the end; and that the faults really happened (aborts, failures, kills, rejections).
"""

from __future__ import annotations

from hybrid_transfer.soak import SoakSpec, render, run_soak
from hybrid_transfer.soak.worker import TINY_MODEL


def test_short_soak_leaks_nothing_and_moves_no_wrong_byte():
    spec = SoakSpec(requests=300, batch=50, num_blocks=1200, lease_s=3.0, heartbeat_s=0.2, read_deadline_s=4.0,
                    replay_rate=0.04, edit_rate=0.03, forge_every=2, seed=7, read_transport="nixl")
    report = run_soak(spec)
    print(render(report))
    assert report.reads_by_transport and set(report.reads_by_transport) == {"nixl"}, report.reads_by_transport
    assert report.wrong_bytes == 0 and report.byte_mismatches == 0
    assert (report.blocks_pinned, report.quarantined, report.handles_leaked) == (0, 0, 0)
    assert report.unfinished == 0 and report.reported_twice == 0
    assert report.ok, report.checks
    # The faults happened: both kills, aborts, failures, attacks refused, forged traffic rejected.
    assert len(report.kills) == 2 and report.lost_with_consumer + report.lost_with_producer > 0
    assert report.completed > 0 and report.aborted > 0 and report.failed_by_cause
    for kind, outcomes in report.attacks.items():
        assert outcomes and "done" not in outcomes, (kind, outcomes)
    assert report.forged_sent > 0 and sum(report.rejected_messages.values()) > 0
    assert report.stranger_refusals and "ACCEPTED" not in report.stranger_refusals
    # The second consumer acted on live tickets and hostile params were drawn; every one typed or ended.
    actions = {k.split("/")[0] for k in report.rival}
    assert {"decline", "read"} & actions and any(a.startswith("params:") for a in actions), report.rival
    assert not any("/UNTYPED:" in k or "/WRONG" in k for k in report.rival), report.rival


def test_short_soak_over_the_mapped_path_leaks_nothing_and_moves_no_wrong_byte():
    """The same faults with the producer's cache in shared memory: the consumer maps it, and kills, aborts,
    stalls, replays and edits meet a READ that is a copy over the mapping (docs/soak.md#transports)."""
    spec = SoakSpec(requests=280, batch=40, num_blocks=1000, lease_s=3.0, heartbeat_s=0.2, read_deadline_s=4.0,
                    replay_rate=0.04, edit_rate=0.03, forge_every=2, seed=11, read_transport="mapped")
    report = run_soak(spec)
    print(render(report))
    assert report.reads_by_transport.get("shm", 0) > 0, report.reads_by_transport
    assert report.wrong_bytes == 0 and report.byte_mismatches == 0
    assert (report.blocks_pinned, report.quarantined, report.handles_leaked) == (0, 0, 0)
    assert report.unfinished == 0 and report.reported_twice == 0
    assert report.ok, report.checks
    assert len(report.kills) == 2 and report.completed > 0 and report.aborted > 0
    for kind, outcomes in report.attacks.items():
        assert outcomes and "done" not in outcomes, (kind, outcomes)
    assert report.forged_sent > 0 and sum(report.rejected_messages.values()) > 0
    assert not any("/UNTYPED:" in k or "/WRONG" in k for k in report.rival), report.rival


def test_tiny_model_matches_the_tests_tiny_model():
    from tiny_model import TINY_CONFIG

    assert TINY_MODEL == TINY_CONFIG
