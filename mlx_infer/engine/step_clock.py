"""When the work an engine thread runs now began: a step that never ends (a stopped peer rank, a hang)
fails nothing, so only its age shows that nothing moves (``/health``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class StepClock:
    def __init__(self) -> None:
        self._started: float | None = None  # time.monotonic() of the step running now, if any

    @contextmanager
    def timing(self) -> Iterator[None]:
        self._started = time.monotonic()
        try:
            yield
        finally:
            self._started = None

    def stalled_for(self) -> float:
        """Seconds the step running now has taken so far (0 between steps)."""
        started = self._started
        return 0.0 if started is None else time.monotonic() - started
