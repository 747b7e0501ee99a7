"""Request lifecycles: one function changes a state, along the edges of the lifecycle only."""

from __future__ import annotations

import pytest

from hybrid_transfer.engine.agent import XferState
from hybrid_transfer.engine.lifecycle.state import TERMINAL, Hold, HoldState, ReadRequest, ReadState, transition
from hybrid_transfer.errors import RequestStateError

# Failures pass through DRAINING and aborts through ABORTING (the quarantine), never straight to the end.
ALLOWED = {
    (ReadState.WAITING_PEER, ReadState.READING), (ReadState.WAITING_PEER, ReadState.DRAINING),
    (ReadState.WAITING_PEER, ReadState.ABORTING), (ReadState.READING, ReadState.DONE),
    (ReadState.READING, ReadState.DRAINING), (ReadState.READING, ReadState.ABORTING),
    (ReadState.DRAINING, ReadState.FAILED), (ReadState.ABORTING, ReadState.ABORTED),
}
HOLD_ALLOWED = {
    (HoldState.HELD, HoldState.FREED), (HoldState.HELD, HoldState.EXPIRED), (HoldState.HELD, HoldState.ABORTING),
    (HoldState.HELD, HoldState.ABORTED), (HoldState.ABORTING, HoldState.ABORTED),
}


def _read(state: ReadState) -> ReadRequest:
    return ReadRequest("r", None, ((1,),), None, started_at=0.0, deadline=1.0, state=state)


@pytest.mark.parametrize("old", list(ReadState))
@pytest.mark.parametrize("new", list(ReadState))
def test_read_transitions_follow_the_lifecycle(old, new):
    req = _read(old)
    if (old, new) in ALLOWED:
        transition(req, new, now=5.0)
        assert req.state is new and req.changed_at == 5.0
    else:
        with pytest.raises(RequestStateError) as info:
            transition(req, new, now=5.0)
        assert info.value.state == old.value and req.state is old


@pytest.mark.parametrize("old", list(HoldState))
@pytest.mark.parametrize("new", list(HoldState))
def test_hold_transitions_follow_the_lifecycle(old, new):
    hold = Hold("h", nonce=1, block_ids=((1,),), num_tokens=1, held_at=0.0, state=old)
    if (old, new) in HOLD_ALLOWED:
        transition(hold, new, now=3.0)
        assert hold.state is new and hold.changed_at == 3.0
    else:
        with pytest.raises(RequestStateError):
            transition(hold, new, now=3.0)
        assert hold.state is old


def test_terminal_states_never_change_and_holds_free_once():
    hold = Hold("h", nonce=1, block_ids=((1,),), num_tokens=1, held_at=0.0)
    transition(hold, HoldState.FREED, now=1.0)
    with pytest.raises(RequestStateError):
        transition(hold, HoldState.FREED, now=2.0)
    with pytest.raises(RequestStateError):
        transition(_read(ReadState.DONE), ReadState.FAILED, now=1.0)
    for terminal in TERMINAL:
        assert not any(old is terminal for old, _ in ALLOWED | HOLD_ALLOWED)


def test_nixl_status_strings_map_to_handle_states():
    assert XferState.parse("DONE") is XferState.DONE
    assert XferState.parse("PROC") is XferState.PROC
    assert XferState.parse("ERR") is XferState.ERR
    assert XferState.parse("anything else") is XferState.ERR
