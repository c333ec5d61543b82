"""What waiting for a late rank costs (bench_waiting.py): in every round
rank 0 arrives late at one small collective, once while the others wait by
sleeping between tests of its nonblocking form and once while they spin in
``MPI_Wait``, the order alternating from round to round; the CPU the
waiting ranks used, and how long the late rank then spent in the call."""
from __future__ import annotations

import time
from typing import Callable, List, Tuple

import numpy as np
from mpi4py import MPI

from .. import waiting
from .timing import slowest

WAYS = ("sleep", "spin")
COLLECTIVES = ("Barrier", "Allgather", "Allreduce")


def call(comm: MPI.Comm, name: str, send: np.ndarray, recv: np.ndarray) -> None:
    """One ``name`` collective of ``send`` (one element), the way ``waiting`` waits."""
    if name == "Barrier":
        waiting.collective(comm, name)
    elif name == "Allgather":
        waiting.collective(comm, name, send, recv, nbytes=send.nbytes)
    else:
        waiting.collective(comm, name, send, recv[:1], nbytes=send.nbytes)


def one_round(comm: MPI.Comm, name: str, late: float, sleep: bool) -> Tuple[float, float]:
    """Seconds of CPU this rank used in the call, and of wall time in it."""
    send, recv = np.full(1, comm.rank, np.int32), np.zeros(comm.size, np.int32)
    with waiting.sleeping(sleep):
        comm.Barrier()
        if comm.rank == 0:
            time.sleep(late)
        start, cpu = time.perf_counter(), time.process_time()
        call(comm, name, send, recv)
        return time.process_time() - cpu, time.perf_counter() - start


def measure(comm: MPI.Comm, collective: str, late: float, warmup: int, repeat: int,
            progress: Callable[[str], None]) -> List[dict]:
    """Each way's medians over the timed rounds (collective): the most CPU a
    waiting rank used, and rank 0's time in the call after arriving ``late``
    seconds after the others (its median and 90th percentile). Rank 0 tells
    ``progress`` how far the rounds are."""
    rounds = warmup + repeat
    cpu, after = np.zeros((len(WAYS), rounds)), np.zeros((len(WAYS), rounds))
    for i in range(rounds):
        order = range(len(WAYS)) if i % 2 == 0 else reversed(range(len(WAYS)))
        for w in order:
            cpu[w, i], after[w, i] = one_round(comm, collective, late, WAYS[w] == "sleep")
        if comm.rank == 0 and (i + 1) % max(1, rounds // 5) == 0:
            progress(f"round {i + 1}/{rounds}")
    waited = cpu * (comm.rank != 0)  # the late rank did not wait
    most = slowest(comm, waited)  # ``after`` is rank 0's own
    return [dict(way=way, cpu_median=float(np.median(most[w, warmup:])),
                 after_median=float(np.median(after[w, warmup:])),
                 after_p90=float(np.percentile(after[w, warmup:], 90)))
            for w, way in enumerate(WAYS)]
