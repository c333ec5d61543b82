"""What ``auto`` measures of the cluster it runs on, where no calibration
says: the link between nodes, and how many ranks share a core.

The CPU preset prices every network at 25 Gbit/s, and every rank as owning
a core. On a 1 Gbit/s link that sends a 6.5M bucket at density 0.1 dense,
where a sparse algorithm takes half the time; on 4 ranks sharing 2 cores it
underprices every pass over memory. Both are collective over
``topology.world`` and give every rank rank 0's figures.
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Callable, Iterable, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..consensus import raise_if_any
from ..errors import SparCommError
from ..mpi_strings import processor_name
from ..topology import Topology

FIRST_BYTES = 1 << 14
LAST_BYTES = 1 << 24
#: A message grows until its bytes (latency aside) take this long one way.
TRANSFER_SECONDS = 0.02
#: Round trips timed for the latency (the least taken: a busy core only adds
#: to it) and at the final size (the median taken).
LATENCY_TRIPS = 5
BANDWIDTH_TRIPS = 3
_SMALL = 8
_TAG = 71


def time_link(round_trip: Callable[[int], float]) -> Tuple[float, float]:
    """(latency in seconds, seconds per byte) one way, from ``round_trip(nbytes)``,
    the seconds of one message of ``nbytes`` there and back: the latency from
    the fastest small trip, the bandwidth from a message doubling from
    ``FIRST_BYTES`` until its bytes take ``TRANSFER_SECONDS`` one way (or it
    reaches ``LAST_BYTES``); tens of milliseconds on a fast link, a few tenths
    of a second at 100 Mbit/s."""
    round_trip(_SMALL)  # the connection's first message
    alpha = min(round_trip(_SMALL) for _ in range(LATENCY_TRIPS)) / 2
    nbytes = FIRST_BYTES
    while nbytes < LAST_BYTES and round_trip(nbytes) / 2 - alpha < TRANSFER_SECONDS:
        nbytes *= 2
    transfer = float(np.median([round_trip(nbytes) for _ in range(BANDWIDTH_TRIPS)])) / 2 - alpha
    return alpha, max(transfer, 1e-9) / nbytes  # never a transfer timed as free


def _partner(leaders: MPI.Comm) -> int:
    """The first leader on another machine than leader 0 (so that emulated
    nodes spread over real hosts time the network), else leader 1."""
    machines = leaders.allgather(_machine_id())
    return next((i for i, m in enumerate(machines) if m != machines[0]), 1)


def _pingpong(leaders: MPI.Comm) -> Tuple[Optional[Tuple[float, float]], Optional[str]]:
    """Leader 0 times the link to its partner, which echoes every message;
    the others wait. Before each timed trip leader 0 says its size (untimed:
    a torch.distributed group cannot probe for it), and a size of -1 ends
    the echo. Leader 0's (figures, problem)."""
    partner = _partner(leaders)
    if leaders.rank not in (0, partner):
        return None, None
    buf, size = np.zeros(LAST_BYTES, np.uint8), np.zeros(1, np.int64)
    if leaders.rank != 0:
        while True:
            leaders.Recv(size, source=0, tag=_TAG)
            nbytes = int(size[0])
            if nbytes < 0:
                return None, None
            leaders.Recv([buf, nbytes, MPI.BYTE], source=0, tag=_TAG)
            leaders.Send([buf, nbytes, MPI.BYTE], dest=0, tag=_TAG)

    def round_trip(nbytes: int) -> float:
        size[0] = nbytes
        leaders.Send(size, dest=partner, tag=_TAG)
        start = MPI.Wtime()
        leaders.Send([buf, nbytes, MPI.BYTE], dest=partner, tag=_TAG)
        leaders.Recv([buf, nbytes, MPI.BYTE], source=partner, tag=_TAG)
        return MPI.Wtime() - start

    try:
        return time_link(round_trip), None
    except Exception as error:  # agreed below, so that every rank raises it
        return None, f"{type(error).__name__}: {error}"
    finally:
        size[0] = -1
        leaders.Send(size, dest=partner, tag=_TAG)


def link(topology: Topology) -> Optional[Tuple[float, float]]:
    """(alpha_inter, beta_inter) of the link between two nodes as the
    topology's transport (MPI, or a torch.distributed group) moves messages,
    the same on every rank; None on one node (collective). Raises
    SparCommError on every rank if the timing failed."""
    if topology.num_nodes < 2:
        return None
    figures, problem = None, None
    with waiting.watched("timing the link between nodes for algorithm='auto'", topology.world, patient=True):
        if topology.leader != MPI.COMM_NULL:
            # Over MPI no message of the probe can match another's on a comm of
            # its own; a torch group splits only whole (its sends match by tag).
            leaders = topology.leader.Dup() if topology.transport == "mpi" else topology.leader
            figures, problem = _pingpong(leaders)
            leaders.Free()
        waiting.collective(topology.world, "Barrier")  # the others sleep, leaving the cores to the two timing
        raise_if_any(topology.world, problem and f"timing the link between nodes for algorithm='auto': {problem}",
                     SparCommError)
        return topology.world.bcast(figures, root=0)


def _machine_id() -> str:
    """One string per machine: the boot id, shared by its network namespaces."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return processor_name()


def _cpus() -> Tuple[int, ...]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def cores_for(ranks: Sequence[Tuple[str, Iterable[int]]], priced: Optional[int] = None) -> Optional[int]:
    """``Cluster.cores`` for ranks given as (machine, CPUs they may run on):
    None when no machine has more ranks than CPUs, else the cores that give
    a cluster of ``priced`` ranks (default: these) the most crowded
    machine's ranks per core."""
    counts, cpus = defaultdict(int), defaultdict(set)
    for machine, allowed in ranks:
        counts[machine] += 1
        cpus[machine].update(allowed)
    crowding = max(counts[m] / max(1, len(cpus[m])) for m in counts)
    if crowding <= 1:
        return None
    return max(1, round((len(ranks) if priced is None else priced) / crowding))


def shared_cores(topology: Topology, priced: int) -> Optional[int]:
    """``cores_for`` every rank of ``topology.world``, for a model cluster of
    ``priced`` ranks (collective)."""
    return cores_for(topology.world.allgather((_machine_id(), _cpus())), priced)
