"""A pack source's step changes only along its edges (engine/pack/steps.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybrid_transfer.engine.pack.steps import SETTLED, SourceStep, step_to
from hybrid_transfer.errors import RequestStateError


def test_a_staged_source_goes_read_scatter_done():
    source = SimpleNamespace(step=SourceStep.WAITING)
    for step in (SourceStep.READING, SourceStep.SCATTERING, SourceStep.DONE):
        step_to(source, step)
    assert source.step in SETTLED


@pytest.mark.parametrize(("start", "bad"), [
    (SourceStep.WAITING, SourceStep.SCATTERING),  # nothing was read
    (SourceStep.READING, SourceStep.DIRECT),  # a staged READ is in flight: no second read of the same bytes
    (SourceStep.DONE, SourceStep.READING),
    (SourceStep.DIRECT, SourceStep.READING),
])
def test_impossible_steps_raise_and_leave_the_step(start, bad):
    source = SimpleNamespace(step=start)
    with pytest.raises(RequestStateError, match=f"{start.value} to {bad.value}"):
        step_to(source, bad, "r1")
    assert source.step is start
