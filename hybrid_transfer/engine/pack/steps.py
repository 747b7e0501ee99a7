"""A source's steps through the consumer's pack path, and the one function that changes a step.

Like request states (engine/state.py): the enum and its edges live here, and ``step_to`` is the
only way a step changes, so an impossible move (scattering what was never read) raises instead
of passing silently.
"""

from __future__ import annotations

from hybrid_transfer.errors import RequestStateError
from hybrid_transfer.identity_enum import IdentityEnum


class SourceStep(IdentityEnum):
    WAITING = "waiting"  # for the source's Staged notification: where it staged the request
    READING = "reading"  # one READ of the plan's ranges of the source's staging is in flight
    SCATTERING = "scattering"  # the READ is DONE; the scatter into the local blocks runs
    DONE = "done"  # the scatter finished: the bytes sit in their final place
    DIRECT = "direct"  # fallback: the source's coalesced rows went out as one direct READ


_EDGES = {
    SourceStep.WAITING: frozenset({SourceStep.READING, SourceStep.DIRECT}),
    SourceStep.READING: frozenset({SourceStep.SCATTERING}),
    SourceStep.SCATTERING: frozenset({SourceStep.DONE}),
    SourceStep.DONE: frozenset(),
    SourceStep.DIRECT: frozenset(),
}
SETTLED = frozenset({SourceStep.DONE, SourceStep.DIRECT})  # nothing more happens to the source's bytes here


def step_to(source, step: SourceStep, request_id: str = "?") -> None:
    """Move ``source`` (anything with a ``step``) to ``step``.

    Raises:
        RequestStateError: ``step`` does not follow the source's current step.
    """
    if step not in _EDGES[source.step]:
        raise RequestStateError(f"pack source cannot go from {source.step.value} to {step.value}",
                                request_id=request_id, state=source.step.value)
    source.step = step
