"""When to stop early: ``--stop-after``, ``--time-limit`` and the signals a
batch scheduler sends before a job's wall time ends (SIGTERM, SIGUSR1); and
when to save a periodic checkpoint by the clock (``--checkpoint-period``).

A signal or a clock reaches the ranks at different moments, so each step the
ranks take the bitwise OR of their local verdicts in one tiny Allreduce: all of
them stop (or save) after the same step, and the checkpoint is consistent. A
rank stuck in a collective never reaches that Allreduce: the watchdog of
``spar_comm.waiting`` ends it after the signal instead.
"""
from __future__ import annotations

import signal
import time
from typing import Optional

from .distributed import Group

STOP_AFTER, TIME_LIMIT, SIGNAL = 1, 2, 4
REASONS = {STOP_AFTER: "--stop-after", TIME_LIMIT: "--time-limit", SIGNAL: "signal"}
STOPS = STOP_AFTER | TIME_LIMIT | SIGNAL
#: Not a stop: a checkpoint period has passed (on some rank's clock).
SAVE = 8
#: A file (the trace) could not be written on some rank: the loop raises it on every rank.
WRITE_FAILED = 16


class StopControl:
    """Says, collectively, whether the run must stop, or save, after the current step."""

    def __init__(self, group: Group, stop_after: Optional[int], time_limit: Optional[float],
                 save_period: Optional[float] = None):
        """``save_period``: seconds between periodic checkpoints (None: none by the clock)."""
        self.group = group
        self.stop_after = stop_after
        self.deadline = None if time_limit is None else time.monotonic() + time_limit
        self.save_period = save_period
        self.saved()
        self.signalled: Optional[str] = None
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.signalled = signal.Signals(signum).name

    def saved(self) -> None:
        """A checkpoint was written: the next one is due a period from now."""
        self.save_at = None if not self.save_period else time.monotonic() + self.save_period

    def check(self, steps_done: int, write_failed: bool = False) -> int:
        """The agreed flags after ``steps_done`` steps: the reasons to stop
        (``STOPS``; 0: go on), ``SAVE`` and ``WRITE_FAILED``. Collective."""
        code = WRITE_FAILED if write_failed else 0
        if self.stop_after is not None and steps_done >= self.stop_after:
            code |= STOP_AFTER
        if self.deadline is not None and time.monotonic() >= self.deadline:
            code |= TIME_LIMIT
        if self.signalled:
            code |= SIGNAL
        if self.save_at is not None and time.monotonic() >= self.save_at:
            code |= SAVE
        return self.group.any_flags(code)

    @staticmethod
    def describe(code: int) -> str:
        return " and ".join(text for bit, text in REASONS.items() if code & bit)

    def restore(self) -> None:
        """Give the signals back their default handlers."""
        for sig in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(sig, signal.SIG_DFL)
