"""Step fences: a block goes back to the embedder only after the engine step that last wrote it finished.

With asynchronous scheduling an engine queues step N+1 before step N has run on the device, so
the scheduler may free a block that a kernel already queued will still write. The embedder
marks blocks with the step that last writes them (``mark``) and reports finished steps
(``finish``); steps finish in order, so finishing step s finishes every step <= s. Both the
consumer's quarantine and the producer's release of freed holds consult one StepFences.
"""

from __future__ import annotations

from collections.abc import Iterable

from hybrid_transfer.errors import ConfigError


class StepFences:
    """Per block, the last unfinished step that writes it; owned by one engine's owner thread."""

    def __init__(self):
        self.finished_step = -1
        self._step: dict[int, int] = {}  # block id -> last marked step, only while that step is unfinished

    def mark(self, block_ids: Iterable[int], step: int) -> None:
        """Blocks written by ``step`` (a non-negative engine step number); a finished step fences nothing."""
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative integer", field="step", value=step)
        if step <= self.finished_step:
            return
        for b in block_ids:
            b = int(b)
            if self._step.get(b, -1) < step:
                self._step[b] = step

    def finish(self, step: int) -> None:
        """Every step up to and including ``step`` has finished (reporting an older step again is harmless)."""
        if not isinstance(step, int) or step < 0:
            raise ConfigError(f"step={step!r} must be a non-negative integer", field="step", value=step)
        if step <= self.finished_step:
            return
        self.finished_step = step
        self._step = {b: s for b, s in self._step.items() if s > step}

    def pending(self, block_ids: Iterable[int]) -> dict[int, int]:
        """The blocks among ``block_ids`` still fenced, with their step."""
        return {b: s for b in block_ids if (s := self._step.get(int(b))) is not None}

    def is_clear(self, block_ids: Iterable[int]) -> bool:
        return not self._step or not any(int(b) in self._step for b in block_ids)

    @property
    def num_fenced_blocks(self) -> int:
        return len(self._step)
