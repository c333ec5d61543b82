"""When to stop early: ``--stop-after``, ``--time-limit`` and the signals a
batch scheduler sends before a job's wall time ends (SIGTERM, SIGUSR1).

A signal or a clock reaches the ranks at different moments, so each step the
ranks take the bitwise OR of their local verdicts in one tiny Allreduce: all of
them stop after the same step, and the checkpoint is consistent.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

from .distributed import Group

STOP_AFTER, TIME_LIMIT, SIGNAL = 1, 2, 4
REASONS = {STOP_AFTER: "--stop-after", TIME_LIMIT: "--time-limit", SIGNAL: "signal"}


class StopControl:
    """Says, collectively, whether the run must stop after the current step."""

    def __init__(self, group: Group, stop_after: Optional[int], time_limit: Optional[float]):
        self.group = group
        self.stop_after = stop_after
        self.deadline = None if time_limit is None else time.monotonic() + time_limit
        self.signalled: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = signal.Signals(signum).name

    def check(self, steps_done: int) -> int:
        """The agreed reason code (0: go on) after ``steps_done`` steps. Collective."""
        code = 0
        if self.stop_after is not None and steps_done >= self.stop_after:
            code |= STOP_AFTER
        if self.deadline is not None and time.monotonic() >= self.deadline:
            code |= TIME_LIMIT
        if self.signalled:
            code |= SIGNAL
        return self.group.any_flags(code)

    @staticmethod
    def describe(code: int) -> str:
        return " and ".join(text for bit, text in REASONS.items() if code & bit)

    def restore(self) -> None:
        """Give the signals back their default handlers."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
