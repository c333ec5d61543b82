"""The one thread that runs the optimizer's and the DDP hook's communication,
in the order their jobs were handed over, and that the interpreter's exit
waits for.

One thread for the process, not one for each optimizer or hook: jobs handed
over in the same order on every rank reach the network in that order, and
no two of spar_comm's users in one process (an optimizer and a hook, or
several optimizers) communicate from two threads at once. A process forked
from one that had it (a fork copies no thread) makes its own.

A daemon thread is left running while the interpreter shuts down. One that
comes back from torch's C++ then (a collective, a copy, a future's
``set_result`` that woke the main thread before it returned) is ended by
``pthread_exit``, whose unwinding through C++ aborts the whole process:
"terminate called without an active exception", status -6, after a run that
finished its work. So the exit (``atexit``, which runs before the shutdown)
stops the thread: it finishes the job it is in, starts no other (its peers
may be gone), and leaves. A thread that stays in a job for ``EXIT_GRACE_S``
(a collective whose peers are gone) is left as it is: it never comes back,
and the exit goes on.
"""
from __future__ import annotations

import atexit
import os
import queue
import threading
from typing import Any, Callable, Optional, Tuple

#: Seconds the exit waits for the thread to finish the job it is in.
EXIT_GRACE_S = 10.0

_STOP = object()


class CommThread:
    """``run(job)`` on a thread of its own, for each ``(run, job)`` put, in order."""

    def __init__(self, name: str):
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def put(self, run: Callable[[Any], None], job: Any) -> None:
        self._jobs.put((run, job))

    def stop(self, grace: float) -> None:
        """Finish the job in hand, start no other; wait at most ``grace`` seconds."""
        self._stopping = True
        self._jobs.put(_STOP)
        self._thread.join(grace)

    def _serve(self) -> None:
        while True:
            item: Tuple[Callable[[Any], None], Any] = self._jobs.get()
            if self._stopping:
                return
            run, job = item
            run(job)


_THREAD: Optional[CommThread] = None
_MADE = threading.Lock()


def submit(run: Callable[[Any], None], job: Any) -> None:
    """Run ``run(job)`` on the process's communication thread, after every job
    submitted before it; the thread is made on first use."""
    global _THREAD
    with _MADE:
        if _THREAD is None:
            _THREAD = CommThread("spar_comm-communication")
        thread = _THREAD
    thread.put(run, job)


def _forked() -> None:
    """In a forked child: the parent's thread was not copied, and its lock may have been held."""
    global _THREAD, _MADE
    _THREAD, _MADE = None, threading.Lock()


os.register_at_fork(after_in_child=_forked)


@atexit.register
def _stop() -> None:
    if _THREAD is not None:
        _THREAD.stop(EXIT_GRACE_S)
