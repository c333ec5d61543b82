"""A failure inside an allreduce on one rank ends the whole job at once,
instead of leaving the other ranks waiting in a collective."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, find_mpiexec

SCRIPT = """
import numpy as np
from mpi4py import MPI
from spar_comm import Topology, make_allreducer
from spar_comm.kernels import register

def broken(x, k):
    if MPI.COMM_WORLD.rank == 1:
        raise MemoryError("injected on rank 1")
    return np.arange(k)

register("broken_on_rank_1", lambda: broken, exact=False)
reducer = make_allreducer("topka", Topology(), 100, selector="broken_on_rank_1")
reducer.allreduce(np.ones(100, np.float32))
print("not reached", flush=True)
"""


@pytest.mark.openmpi
@pytest.mark.slow
def test_a_failure_on_one_rank_aborts_the_job():
    result = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-c", SCRIPT], cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "[rank 1] topka allreduce failed" in result.stderr and "injected on rank 1" in result.stderr
    assert "not reached" not in result.stdout
