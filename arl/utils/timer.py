"""`PhaseTimer`: seconds per named phase, summed until they are taken (verl's `marked_timer` / `simple_timer` over a
dict). The learner times its wait and step with it, the actor its update, the rollout worker its groups and
evaluations: one way to time, instead of a pair of clock readings in each place."""

from __future__ import annotations

import contextlib
import time
from typing import Callable, Iterator, Optional


class PhaseTimer:
    """Accumulates seconds per phase name; `pop` hands them over and starts afresh (per step, per report).

    `phase` times a block. `start` times consecutive phases where one block would cut across code that is not one
    (a loop body's "wait" then "step"): it ends the running phase and starts the next; `stop` and `pop` end it.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.seconds: dict[str, float] = {}
        self._running: Optional[tuple[str, float]] = None  # (phase, when it started)

    def start(self, name: str) -> None:
        """End the running phase (if any) and start `name`."""
        self.stop()
        self._running = (name, self._clock())

    def stop(self) -> None:
        """End the running phase (if any): its seconds are added under its name."""
        if self._running is not None:
            name, t0 = self._running
            self._running = None
            self.seconds[name] = self.seconds.get(name, 0.0) + self._clock() - t0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block under `name` (a phase already running ends first)."""
        self.start(name)
        try:
            yield
        finally:
            self.stop()

    def pop(self) -> dict[str, float]:
        """End the running phase and return the seconds so far per phase; the timer starts afresh."""
        self.stop()
        out, self.seconds = self.seconds, {}
        return out
