"""The soak (soak.py): many calls with every algorithm in turn, then many
builds and frees of each allreducer, each rank's resources snapshotted at
the start and after each part, so that a call or a build that keeps
anything (memory, a file descriptor, a window of shared memory) shows as
growth (``resources``)."""
from __future__ import annotations

import time
from typing import Callable, Dict, List, Sequence, Tuple

import numpy as np

from ..costmodel.auto import make_allreducer
from ..topology import Topology
from .resources import snapshot


def soak(topology: Topology, algorithms: Sequence[str], size: int, density: float, selector: str, steps: int,
         rebuilds: int, progress: Callable[[str], None]) -> Tuple[Dict[str, List[dict]], Dict[str, float]]:
    """Every rank's snapshot at the start (after one warm-up call of each
    allreducer: first-call allocations are not a leak), after ``steps``
    calls (step i with algorithm i mod their number) and after ``rebuilds``
    builds, calls and frees of each, and each phase's seconds (collective).
    Rank 0 tells ``progress`` each phase's time and largest resident memory."""
    world = topology.world
    rng = np.random.default_rng(world.rank)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(4)]
    out = np.empty(size, np.float32)

    def build(algorithm: str):
        return make_allreducer(algorithm, topology, size, "float32", density, selector, shared_buffer=True)

    snapshots: Dict[str, List[dict]] = {}
    seconds: Dict[str, float] = {}

    def record(phase: str, began: float) -> None:
        seconds[phase] = time.perf_counter() - began
        snapshots[phase] = world.allgather(snapshot())
        if world.rank == 0:
            rss = max(s["rss_kib"] for s in snapshots[phase])
            progress(f"# {phase}: {seconds[phase]:.1f} s; largest RSS {rss / 1024:.1f} MiB")

    began = time.perf_counter()
    reducers = [build(algorithm) for algorithm in algorithms]
    for reducer in reducers:  # first calls compile and allocate: not a leak
        reducer.allreduce(grads[0], out=out)
    record("start", began)

    began = time.perf_counter()
    for step in range(steps):
        reducers[step % len(reducers)].allreduce(grads[step % len(grads)], out=out)
    record("steps", began)
    for reducer in reducers:
        reducer.free()
    del reducers

    began = time.perf_counter()
    for algorithm in algorithms:
        for _ in range(rebuilds):
            reducer = build(algorithm)
            reducer.allreduce(grads[0], out=out)
            reducer.free()
    del reducer
    record("rebuilt", began)
    return snapshots, seconds
