"""Waiting for other ranks without taking their cores.

MPICH and Open MPI wait by polling: a rank blocked in a collective spins at
full speed until the last rank arrives. Where cores are shared (more ranks
than cores, or the communication thread that ``DistributedOptimizer`` runs
beside backward) the spinning rank takes CPU from the ranks it waits for.

So the calls that mostly wait (the check at the start of every allreduce,
the node's fences, and small messages, which MPI moves in a few steps)
start the nonblocking form of the collective and test it, sleeping between
tests, the pause doubling from ``FIRST_PAUSE``. MPI advances a collective's
schedule only inside a rank's MPI calls, and the short-message algorithms
take about log2(p) rounds over p ranks: the rank that arrives last finds
the others asleep, and each round may wait for a sleeper's pause. So a
pause is at most ``MAX_PAUSE`` divided by ceil(log2 p), and the pauses of
those rounds add about ``MAX_PAUSE``, plus what the system oversleeps each
time (collectives near ``SMALL_BYTES`` may take more rounds). Large
messages keep the blocking call, since MPI moves their bytes only while it
is polled. On 4 ranks over 2 cores this takes a tenth or more off a
17M-parameter MLP's ``hitopk`` step (docs/results/peers.md).

``SPAR_COMM_WAIT=spin`` waits in MPI instead (``MPI_Wait``), for dedicated
cores where the wake-up latency is what counts. Either way the MPI calls are
the same, so ranks may differ in it: MPI never matches a blocking collective
with a nonblocking one, so the choice between them depends only on message
sizes that every rank shares.
"""
from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Iterator, Optional

from mpi4py import MPI

#: ``sleep`` (the default) or ``spin``; read when a ``Topology`` is made.
ENV_WAIT = "SPAR_COMM_WAIT"
#: Seconds of the first pause, and of the pauses a collective's rounds share.
FIRST_PAUSE = 1e-5
MAX_PAUSE = 2e-4
#: Collectives of at most this many bytes a rank go nonblocking (a rail's
#: exchange of top-k pairs, 69 KB for a 17M model at density 0.001, is one).
SMALL_BYTES = 1 << 18
#: Whether waits sleep between tests (``read_environment`` sets it).
SLEEP = True


def read_environment() -> Optional[str]:
    """Set ``SLEEP`` from ``SPAR_COMM_WAIT``; a problem with its value, or None."""
    global SLEEP
    text = os.environ.get(ENV_WAIT, "sleep").strip()
    if text not in ("sleep", "spin"):
        return f"{ENV_WAIT}={text!r}: expected 'sleep' or 'spin'"
    SLEEP = text == "sleep"
    return None


@contextlib.contextmanager
def sleeping(on: bool) -> Iterator[None]:
    """Waits sleep (``on``) or spin inside the block, as before it after:
    a benchmark's way of comparing both in one job."""
    global SLEEP
    held, SLEEP = SLEEP, on
    try:
        yield
    finally:
        SLEEP = held


def longest_pause(ranks: int) -> float:
    """The cap on one pause in a collective over ``ranks``: ``MAX_PAUSE``
    shared by its ceil(log2(ranks)) rounds, and never below ``FIRST_PAUSE``."""
    rounds = max(1, (ranks - 1).bit_length())
    return max(FIRST_PAUSE, MAX_PAUSE / rounds)


def wait(request: MPI.Request, ranks: int) -> None:
    """Complete ``request`` of a collective over ``ranks``: sleeping between
    tests, or in ``MPI_Wait``."""
    if not SLEEP:
        request.Wait()
        return
    pause, longest = FIRST_PAUSE, longest_pause(ranks)
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, longest)


def collective(comm: MPI.Comm, name: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> None:
    """``comm.<name>(*args, **kwargs)`` (``Barrier``, ``Allgather``, ...): its
    nonblocking form and ``wait`` when ``nbytes`` (this call's bytes a rank,
    equal on every rank) is at most ``SMALL_BYTES``, else the blocking call."""
    if nbytes <= SMALL_BYTES:
        wait(getattr(comm, "I" + name.lower())(*args, **kwargs), comm.size)
    else:
        getattr(comm, name)(*args, **kwargs)
