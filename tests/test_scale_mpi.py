"""The serial reference checks at 8 to 16 ranks (``make test-scale``, not
``make test``: tests/run_scale.py launches them). Nodes are the ones the
launch gives: emulated ones of SPAR_COMM_RANKS_PER_NODE ranks on one host,
or, where that variable is unset, real ones found by ``Split_type`` on the
emulated hosts of spar_comm.emucluster."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI
from test_collectives_mpi import STEPS, integer_grads

from mpi_helpers import assert_all, assert_identical_bits
from reference import Reference, reproducible
from run_scale import LAYOUTS
from spar_comm import Topology, make_allreducer

COMM = MPI.COMM_WORLD
pytestmark = pytest.mark.worlds(*sorted({ranks for ranks, _ in LAYOUTS}))  # tests/run_scale.py's launches


@pytest.fixture(scope="module")
def topology():
    topo = Topology()
    yield topo
    topo.free()


@pytest.mark.mpi(min_size=8)
def test_the_nodes_are_the_launchs(topology):
    """The reference cuts the ranks into consecutive nodes of the largest
    node's size; so must the launch have, whatever found the nodes."""
    first, expected = 0, []
    while first < COMM.size:
        expected.append(min(max(topology.node_sizes), COMM.size - first))
        first += expected[-1]
    assert_all(COMM, topology.node_sizes == expected, f"nodes {topology.node_sizes}, expected {expected}")


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("algorithm", reproducible())
@pytest.mark.parametrize("n, density", [(13, 0.2), (1037, 0.05), (300, 1.0)])
def test_matches_serial_reference(topology, algorithm, n, density):
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, topology, n, "float32", density=density, selector="exact")
    ref = Reference(algorithm, p, max(topology.node_sizes), n, "float32", density)
    for step in range(STEPS):
        grads = integer_grads(n, step, p, n, "float32")
        out = reducer.allreduce(grads[rank])
        expected = ref.step(grads)
        assert_all(COMM, np.array_equal(out, expected), f"step {step}: output differs from the reference")
        assert_all(COMM, np.array_equal(reducer.residual_full(), ref.residuals[rank]),
                   f"step {step}: residual differs from the reference")
        assert_identical_bits(COMM, out, "output")
    reducer.free()
