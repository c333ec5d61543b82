"""Waits that sleep: a rank waiting for a late one leaves the core, every
collective of a channel gives MPI's result on both sides of the size limit,
and ranks that differ in SPAR_COMM_WAIT still meet."""
from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import REFERENCE_WORLDS, assert_all
from spar_comm import ConfigError, Topology, waiting
from spar_comm.collectives.channel import Channel, displacements
from spar_comm.topology import shard_bounds

COMM = MPI.COMM_WORLD
LATE = 0.4  # seconds rank 0 arrives late
pytestmark = pytest.mark.openmpi  # make test-openmpi: each library's nonblocking calls, waited on by sleeping or spinning


@pytest.fixture(params=["sleep", "spin"])
def mode(request, monkeypatch):
    monkeypatch.setattr(waiting, "SLEEP", request.param == "sleep")
    return request.param


@pytest.mark.mpi(min_size=2)
def test_a_rank_waiting_for_a_late_one_sleeps(monkeypatch):
    """The ranks waiting for a late one spend most of the wait asleep.

    Time asleep, not CPU used: a rank's CPU while it waits depends on the
    system's wake-up costs and on how many ranks share its cores (on 4 ranks
    over 2 cores a sleeping wait has used a third of it), whereas a spinning
    wait is never asleep."""
    asleep = []

    def sleep(seconds: float) -> None:
        start = time.perf_counter()
        time.sleep(seconds)
        asleep.append(time.perf_counter() - start)

    monkeypatch.setattr(waiting, "SLEEP", True)
    monkeypatch.setattr(waiting, "time", SimpleNamespace(sleep=sleep))
    comm = COMM.Dup()
    comm.Barrier()
    if comm.rank == 0:
        time.sleep(LATE)
    wall = time.perf_counter()
    waiting.collective(comm, "Barrier")
    wall = time.perf_counter() - wall
    slept = comm.rank == 0 or (wall > LATE / 2 and sum(asleep) > wall / 2)
    assert_all(comm, slept, f"waited {wall:.3f} s, asleep {sum(asleep):.3f} s of it")
    comm.Free()


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("elements", [3, waiting.SMALL_BYTES // 8, waiting.SMALL_BYTES // 8 + 1,
                                      4 * waiting.SMALL_BYTES // 8])
def test_channel_collectives_match_their_definition(mode, elements):
    """float64 blocks at, just past and far past the limit of a nonblocking call."""
    p, r = COMM.size, COMM.rank
    channel = Channel(COMM, "intra", {"t_intra": 0.0, "bytes_intra": 0})
    everyone = [np.arange(elements, dtype=np.float64) * (q + 1) + q for q in range(p)]
    mine = everyone[r]

    total = mine.copy()
    channel.allreduce(total)
    assert_all(COMM, np.array_equal(total, sum(everyone)), "allreduce")

    gathered = np.empty(p * elements)
    channel.allgather(mine, gathered)
    assert_all(COMM, np.array_equal(gathered, np.concatenate(everyone)), "allgather")

    counts = [hi - lo for lo, hi in (shard_bounds(elements, p, q) for q in range(p))]
    shard = np.empty(counts[r])
    channel.reduce_scatter(mine, shard, counts)
    first = displacements(counts)[r]
    assert_all(COMM, np.array_equal(shard, sum(everyone)[first : first + counts[r]]), "reduce_scatter")

    sizes = [max(1, elements // (q + 1)) for q in range(p)]  # unequal blocks
    varied = np.empty(sum(sizes))
    channel.allgatherv(everyone[r][: sizes[r]], varied, sizes)
    assert_all(COMM, np.array_equal(varied, np.concatenate([e[:s] for e, s in zip(everyone, sizes)])), "allgatherv")

    root = p - 1
    sent = mine.copy() if r == root else np.zeros(elements)
    channel.bcast(sent, root=root)
    assert_all(COMM, np.array_equal(sent, everyone[root]), "bcast")

    summed = np.zeros(elements) if r == root else None
    channel.reduce(mine, summed, root=root)
    assert_all(COMM, r != root or np.array_equal(summed, sum(everyone)), "reduce")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_differ_in_how_they_wait_still_meet(monkeypatch):
    monkeypatch.setattr(waiting, "SLEEP", COMM.rank % 2 == 0)
    channel = Channel(COMM, "intra", {"t_intra": 0.0, "bytes_intra": 0})
    for elements in (1, waiting.SMALL_BYTES // 4 + 1):  # float32: a nonblocking call, then a blocking one
        buf = np.full(elements, COMM.rank + 1, dtype=np.float32)
        channel.allreduce(buf)
        assert_all(COMM, (buf == COMM.size * (COMM.size + 1) // 2).all(), f"allreduce of {elements}")
        waiting.collective(COMM, "Barrier")


@pytest.mark.mpi(min_size=1)
def test_a_bad_setting_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv(waiting.ENV_WAIT, "spinning" if COMM.rank == COMM.size - 1 else "spin")
    monkeypatch.setattr(waiting, "SLEEP", True)
    with pytest.raises(ConfigError, match="SPAR_COMM_WAIT='spinning': expected 'sleep' or 'spin'"):
        Topology()
    monkeypatch.setenv(waiting.ENV_WAIT, "spin")
    topology = Topology()
    assert_all(COMM, waiting.SLEEP is False, "spin was not taken")
    topology.free()
