"""StepFences: a block is clear only once the last step marked as writing it has finished."""

from __future__ import annotations

import pytest

from hybrid_transfer.engine.lifecycle.fences import StepFences
from hybrid_transfer.errors import ConfigError


def test_blocks_stay_fenced_until_their_last_step_finishes():
    fences = StepFences()
    fences.mark([1, 2], 3)
    fences.mark([2], 5)
    fences.mark([2], 4)  # an older step does not lower the fence
    assert fences.pending([1, 2, 3]) == {1: 3, 2: 5} and not fences.is_clear([2])
    fences.finish(3)
    assert fences.pending([1, 2]) == {2: 5} and fences.is_clear([1, 3])
    fences.finish(2)  # reporting an older step again changes nothing
    assert fences.finished_step == 3 and fences.num_fenced_blocks == 1
    fences.finish(5)
    assert fences.is_clear([1, 2]) and fences.num_fenced_blocks == 0


def test_marking_a_finished_step_fences_nothing():
    fences = StepFences()
    fences.finish(7)
    fences.mark([1], 7)
    assert fences.is_clear([1])


@pytest.mark.parametrize("step", [-1, 1.0, "3", None])
def test_steps_are_non_negative_integers(step):
    with pytest.raises(ConfigError):
        StepFences().mark([1], step)
    with pytest.raises(ConfigError):
        StepFences().finish(step)
