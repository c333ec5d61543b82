"""What ``auto`` measures of the cluster it runs on: the link between nodes,
and how many ranks share a core.

The CPU preset prices every network at 25 Gbit/s; on a 1 Gbit/s link that
sends a 6.5M bucket at density 0.1 dense, where a sparse algorithm takes
half the time. So, unless a calibration names the figures, the leaders of
nodes 0 and 1 time a ping-pong once: small messages for the latency, then a
message doubling from ``FIRST_BYTES`` until one way takes ``ONE_WAY_SECONDS``
(or it reaches ``LAST_BYTES``), for the bandwidth. It costs a few tenths of
a second on a slow link and a few milliseconds on a fast one.

Ranks that share cores (an emulated cluster, or more ranks than cores on a
node) stretch every CPU pass of an allreduce; the model knows it as
``Cluster.cores``. Ranks find which of them share a machine by the kernel's
boot id (the same in every network namespace of one machine), and the cores
of a machine are the union of its ranks' CPU affinities.

Both are collective over ``topology.world`` and give every rank the same
figures (rank 0's measurement, broadcast).
"""
from __future__ import annotations

import os
from collections import defaultdict
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..mpi_strings import processor_name
from ..topology import Topology

FIRST_BYTES = 1 << 14
LAST_BYTES = 1 << 24
ONE_WAY_SECONDS = 0.02
#: Round trips timed for the latency (the least taken: a busy core only adds
#: to it) and at the final size (the median taken).
LATENCY_TRIPS = 5
BANDWIDTH_TRIPS = 3
_SMALL = 8
_TAG = 71


def _round_trip(comm: MPI.Comm, buf: np.ndarray, nbytes: int) -> float:
    start = MPI.Wtime()
    comm.Send([buf, nbytes, MPI.BYTE], dest=1, tag=_TAG)
    comm.Recv([buf, nbytes, MPI.BYTE], source=1, tag=_TAG)
    return MPI.Wtime() - start


def _median_trip(comm: MPI.Comm, buf: np.ndarray, nbytes: int, trips: int) -> float:
    return float(np.median([_round_trip(comm, buf, nbytes) for _ in range(trips)]))


def _time_link(comm: MPI.Comm, buf: np.ndarray) -> Tuple[float, float]:
    """Leader 0's side: (latency in seconds, seconds per byte) one way."""
    _round_trip(comm, buf, _SMALL)  # the connection's first message
    alpha = min(_round_trip(comm, buf, _SMALL) for _ in range(LATENCY_TRIPS)) / 2
    nbytes = FIRST_BYTES
    while nbytes < LAST_BYTES and _round_trip(comm, buf, nbytes) / 2 < ONE_WAY_SECONDS:
        nbytes *= 2
    one_way = _median_trip(comm, buf, nbytes, BANDWIDTH_TRIPS) / 2
    return alpha, max(one_way - alpha, one_way / 2) / nbytes


def _echo(comm: MPI.Comm, buf: np.ndarray) -> None:
    """Leader 1's side: send every message back until an empty one comes."""
    status = MPI.Status()
    while True:
        comm.Probe(source=0, tag=_TAG, status=status)
        nbytes = status.Get_count(MPI.BYTE)
        comm.Recv([buf, nbytes, MPI.BYTE], source=0, tag=_TAG)
        if nbytes == 0:
            return
        comm.Send([buf, nbytes, MPI.BYTE], dest=0, tag=_TAG)


def link(topology: Topology) -> Optional[Tuple[float, float]]:
    """(alpha_inter, beta_inter) between nodes 0 and 1, the same on every
    rank; None on one node (collective)."""
    if topology.num_nodes < 2:
        return None
    figures = np.zeros(2)
    if topology.leader != MPI.COMM_NULL:
        comm = topology.leader.Dup()  # no message of the probe can match another's
        if comm.rank < 2:
            buf = np.zeros(LAST_BYTES, np.uint8)
            if comm.rank == 0:
                figures[:] = _time_link(comm, buf)
                comm.Send([buf, 0, MPI.BYTE], dest=1, tag=_TAG)
            else:
                _echo(comm, buf)
        comm.Free()
    waiting.collective(topology.world, "Bcast", figures, root=0, nbytes=figures.nbytes)
    return float(figures[0]), float(figures[1])


def _machine_id() -> str:
    """One string per machine: the boot id, shared by its network namespaces."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as handle:
            return handle.read().strip()
    except OSError:
        return processor_name()


def _cpus() -> Tuple[int, ...]:
    if hasattr(os, "sched_getaffinity"):
        return tuple(sorted(os.sched_getaffinity(0)))
    return tuple(range(os.cpu_count() or 1))


def cores_for(ranks: Sequence[Tuple[str, Iterable[int]]]) -> Optional[int]:
    """``Cluster.cores`` for ranks given as (machine, cpus they may run on):
    None when no machine has more ranks than cores, else the cores that give
    the whole cluster the most crowded machine's ranks per core."""
    counts, cpus = defaultdict(int), defaultdict(set)
    for machine, allowed in ranks:
        counts[machine] += 1
        cpus[machine].update(allowed)
    crowding = max(counts[m] / max(1, len(cpus[m])) for m in counts)
    if crowding <= 1:
        return None
    return max(1, round(len(ranks) / crowding))


def shared_cores(topology: Topology) -> Optional[int]:
    """``cores_for`` every rank of ``topology.world`` (collective)."""
    return cores_for(topology.world.allgather((_machine_id(), _cpus())))
