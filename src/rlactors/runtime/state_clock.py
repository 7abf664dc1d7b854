"""Where an actor's time goes: seconds spent in each of a few named states, one state at a time.

    clock = StateClock(("generating", "paused", "idle"), "idle")
    clock.switch("generating")        # at every change; switching to the current state is a no-op
    clock.seconds()                   # {"generating": s, "paused": s, "idle": s}, up to now

A rollout engine keeps one (generating / paused for a weight update or sleep / idle) and the
fully-async producer another (working / blocked by the staleness bound or backpressure), so a run
can say which pool waited on which (`rlactors.pipelines.fully_async`). Invariant: the values of
`seconds()` add up to the time since the clock started (or was reset); time.monotonic is the clock.

    running = LevelClock(); running.set(12)   # a level's time integral (an engine's running requests)
    running.total()                           # level x seconds, summed up to now
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class StateClock:
    def __init__(self, states: tuple[str, ...], state: str, now: Callable[[], float] = time.monotonic):
        if state not in states:
            raise ValueError(f"state {state!r} is not one of {states}")
        self.states, self._now = states, now
        self._lock = threading.Lock()  # the producer's clock is switched by one thread and read by another
        self.reset(state)

    def reset(self, state: str) -> None:
        with self._lock:
            self._totals = dict.fromkeys(self.states, 0.0)
            self.state, self._since = state, self._now()

    def switch(self, state: str) -> None:
        if state not in self._totals:
            raise ValueError(f"state {state!r} is not one of {self.states}")
        with self._lock:
            if state != self.state:
                now = self._now()
                self._totals[self.state] += now - self._since
                self.state, self._since = state, now

    def seconds(self) -> dict[str, float]:
        """Seconds in each state since the start, the current state's running time included."""
        with self._lock:
            totals = dict(self._totals)
            totals[self.state] += self._now() - self._since
        return totals


class LevelClock:
    """The time integral of a level that changes in steps (an engine's running requests): `set` at
    every change, `total()` is the sum of level x seconds up to now. Mean level over a span =
    the difference of two `total()` readings / the span's seconds."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self._now = now
        self._lock = threading.Lock()
        self._total, self._level, self._since = 0.0, 0, now()

    def set(self, level: int) -> None:
        with self._lock:
            now = self._now()
            self._total += self._level * (now - self._since)
            self._level, self._since = level, now

    def total(self) -> float:
        with self._lock:
            return self._total + self._level * (self._now() - self._since)
