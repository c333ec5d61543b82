"""Seconds this process has spent compiling Numba kernels, from Numba's own
compile events. On a cold cache the first calls compile for seconds; a run's
summary reports that apart instead of counting it as the phase it fell in.
Loads from Numba's cache fire no compile event, so a warm cache reads 0."""
from __future__ import annotations

import time

from numba.core import event


class _CompileClock(event.Listener):
    """Sums the outermost compile events: a kernel's callees compile inside it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._began = 0.0

    def on_start(self, event: event.Event) -> None:
        if self._depth == 0:
            self._began = time.perf_counter()
        self._depth += 1

    def on_end(self, event: event.Event) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._began


_CLOCK = _CompileClock()
event.register("numba:compile", _CLOCK)  # once per process: runs read differences, nothing to unregister


def seconds() -> float:
    """Compile seconds so far in this process; a run takes the difference."""
    return _CLOCK.seconds
