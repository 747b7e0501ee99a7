"""Repeated warnings, aggregated: one line per cause per interval, with how many were held back.

A stranger sending 2,000 heartbeats used to log 2,000 WARNING lines. Here the first occurrence of a
cause logs at once; later ones within ``interval_s`` (on the engine's injected clock) are only counted,
and the next occurrence or ``flush()`` after the interval logs one summary line with the count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class _Cause:
    opened_at: float  # when the line that opened this interval was logged
    level: int
    held: int = 0  # occurrences since, not logged
    last: str = ""  # the last held message, shown in the summary


class LogGate:
    """Owned by one engine's owner thread."""

    def __init__(self, logger: logging.Logger, clock: Callable[[], float], interval_s: float = 10.0):
        self._logger = logger
        self._clock = clock
        self._interval_s = interval_s
        self._causes: dict[str, _Cause] = {}

    def log(self, level: int, cause: str, message: str, *args: object) -> None:
        """Log ``message % args`` under ``cause``, or count it when this cause already logged this interval."""
        now = self._clock()
        entry = self._causes.get(cause)
        if entry is not None and now - entry.opened_at < self._interval_s:
            entry.held += 1
            entry.last = message % args if args else message
            return
        if entry is not None and entry.held:
            self._summary(cause, entry, now)
        self._causes[cause] = _Cause(opened_at=now, level=level)
        self._logger.log(level, message, *args)

    def warning(self, cause: str, message: str, *args: object) -> None:
        self.log(logging.WARNING, cause, message, *args)

    def flush(self) -> None:
        """Log the summary of every cause whose interval has passed (call from poll())."""
        now = self._clock()
        for cause, entry in list(self._causes.items()):
            if now - entry.opened_at >= self._interval_s:
                if entry.held:
                    self._summary(cause, entry, now)
                del self._causes[cause]

    def _summary(self, cause: str, entry: _Cause, now: float) -> None:
        self._logger.log(entry.level, "%s: %d more in the last %.0f s (last: %s)", cause, entry.held,
                         now - entry.opened_at, entry.last)
        entry.held = 0
