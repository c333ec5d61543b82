"""The thread that runs the optimizer's and the DDP hook's communication, in
the order its jobs were handed over, and that the interpreter's exit waits for.

A daemon thread is left running while the interpreter shuts down. One that
comes back from torch's C++ then (a collective, a copy, a future's
``set_result`` that woke the main thread before it returned) is ended by
``pthread_exit``, whose unwinding through C++ aborts the whole process:
"terminate called without an active exception", status -6, after a run that
finished its work. So the exit (``atexit``, which runs before the shutdown)
stops every such thread: each finishes the job it is in, starts no other
(its peers may be gone), and leaves. A thread that stays in a job for
``EXIT_GRACE_S`` (a collective whose peers are gone) is left as it is: it
never comes back, and the exit goes on.
"""
from __future__ import annotations

import atexit
import queue
import threading
import weakref
from typing import Any, Callable

#: Seconds the exit waits for a thread to finish the job it is in.
EXIT_GRACE_S = 10.0

_STOP = object()
_LIVE: "weakref.WeakSet[CommThread]" = weakref.WeakSet()


class CommThread:
    """``run(job)`` on a thread of its own, for each job ``put``, in order."""

    def __init__(self, name: str, run: Callable[[Any], None]):
        self._jobs: "queue.Queue[Any]" = queue.Queue()
        self._run = run
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        _LIVE.add(self)
        self._thread.start()

    def put(self, job: Any) -> None:
        self._jobs.put(job)

    def stop(self, grace: float) -> None:
        """Finish the job in hand, start no other; wait at most ``grace`` seconds."""
        self._stopping = True
        self._jobs.put(_STOP)
        self._thread.join(grace)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if self._stopping:
                return
            self._run(job)


@atexit.register
def _stop_all() -> None:
    for thread in list(_LIVE):
        thread.stop(EXIT_GRACE_S)
