"""Work that waits for the end of the backward pass in progress.

Autograd runs the callbacks queued during a backward pass once the pass has
finished, in the order they were queued, on the thread that ran it; a
callback may queue another, which runs after every callback queued before
it (DDP's own end-of-backward work included). An exception raised in one
comes out of ``backward()`` as it is.
"""
from __future__ import annotations

from typing import Callable

import torch


class EndOfBackward:
    """``callback`` queued once for each backward pass in which ``arm`` is called."""

    def __init__(self, callback: Callable[[], None]):
        self.callback = callback
        self._armed_for = -1  # the backward pass the callback is queued for

    def arm(self) -> bool:
        """Queue the callback for the backward pass running now, unless it is
        queued already; False outside a backward pass (nothing queued)."""
        task = torch._C._current_graph_task_id()
        if task == -1:
            return False
        if task != self._armed_for:
            self._armed_for = task
            torch.autograd.Variable._execution_engine.queue_callback(self.callback)
        return True


def after_queued(callback: Callable[[], None]) -> None:
    """From inside a callback: run ``callback`` after every one queued so far."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)
