"""Timing across ranks: a collective call is as slow as its slowest rank, so
every benchmark reports, per round, the largest of the ranks' times, and
then the median over rounds, which a spell of load on a shared machine
hardly moves. One process's own medians too, by the wall clock or by CUDA
events, for what runs on one rank (top-k selection)."""
from __future__ import annotations

import time
from typing import Any, Callable, List, Tuple

import numpy as np
from mpi4py import MPI


def slowest(comm: Any, values: np.ndarray) -> np.ndarray:
    """Elementwise the largest of every rank's ``values`` (same shape on every
    rank; collective: Allreduce with MPI.MAX). NaN stays NaN where any rank has one."""
    values = np.ascontiguousarray(values)
    out = np.empty_like(values)
    comm.Allreduce(values, out, op=MPI.MAX)
    return out


def slowest_median(comm: Any, values: np.ndarray, axis: int = -1) -> np.ndarray:
    """The median along ``axis`` (the rounds) of the slowest rank's values
    (collective); a float where ``values`` is one row."""
    medians = np.median(slowest(comm, values), axis=axis)
    return float(medians) if np.ndim(medians) == 0 else medians


def rotated(count: int, start: int) -> List[int]:
    """``range(count)`` beginning at ``start`` (modulo ``count``): round
    ``start``'s order of ``count`` interleaved modes, so that no mode always
    runs right after the same one."""
    return [(start + j) % count for j in range(count)]


def wall_median(run: Callable[[], object], repeat: int) -> Tuple[float, float]:
    """(median, min) wall-clock seconds of ``repeat`` calls of ``run`` after
    one warm-up call: one process's own time, where no other rank takes part."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times))


def cuda_event_ms(cupy: Any, run: Callable[[], object], repeat: int) -> List[float]:
    """Milliseconds between CUDA events recorded around each of ``repeat``
    calls of ``run`` on CuPy's current stream (the device's time, not the host's)."""
    times = []
    for _ in range(repeat):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return times
