"""The GPU path of every allreducer, run by CI without a GPU: the topology's
``gpu-simulator`` memory stands NumPy arrays in for device memory and runs the
device kernels (selection, and gtopk's merge) under numba-cuda's simulator.
Both hand-offs to MPI are covered: pinned-host staging and CUDA-aware.

The simulator is slow, so this runs at one node layout per world size (the
launch's ``SPAR_COMM_RANKS_PER_NODE``) and on small vectors."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

device_select = pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")

from mpi_helpers import assert_all, assert_identical_bits  # noqa: E402
from reference import Reference  # noqa: E402
from spar_comm import ALGORITHMS, GradientError, NonFiniteGradientError, Topology, make_allreducer  # noqa: E402
from spar_comm.collectives.pairs import PairLayout  # noqa: E402
from spar_comm.device import ENV_CUDA_AWARE  # noqa: E402
from test_collectives_mpi import integer_grads  # noqa: E402

COMM = MPI.COMM_WORLD
N, DENSITY = 300, 0.02
MODES = {"staged": "0", "cuda-aware": "1"}


@pytest.fixture(scope="module", params=list(MODES))
def gpu_topology(request):
    """A topology on the simulated GPU; ``request.param`` picks the MPI hand-off."""
    patch = pytest.MonkeyPatch()
    patch.setenv(ENV_CUDA_AWARE, MODES[request.param])
    topology = Topology(device="gpu-simulator")
    patch.undo()
    yield topology
    topology.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_the_gpu_path_matches_the_serial_reference(gpu_topology, algorithm):
    """Result and residual to the last bit, identical on every rank, in a
    fresh output and in place (``out=grad``)."""
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, gpu_topology, N, "float32", density=DENSITY, selector="threshold")
    ref = Reference(algorithm, p, gpu_topology.emulated_ranks_per_node, N, "float32", DENSITY)
    for step in range(2):
        grads = integer_grads(N, step, p, N, "float32")
        grad = grads[rank].copy()
        out = reducer.allreduce(grad, out=grad) if step else reducer.allreduce(grad)
        expected = ref.step(grads)
        assert_all(COMM, np.array_equal(out, expected), f"step {step}: output differs from the reference")
        assert_all(COMM, np.array_equal(reducer.residual_full(), ref.residuals[rank]), f"step {step}: residual")
        assert_identical_bits(COMM, out, "output")
    reducer.free()


@pytest.mark.mpi(min_size=2)
def test_staging_moves_the_pairs_not_the_vector(gpu_topology):
    """topka stages its k pairs out and the p records in: (p + 1) records, a
    few hundred bytes, against 1,200 for the vector; CUDA-aware stages nothing."""
    reducer = make_allreducer("topka", gpu_topology, N, "float32", density=DENSITY, selector="threshold")
    assert isinstance(reducer.selector, device_select.Threshold)  # the device kernels select
    reducer.allreduce(integer_grads(N, 0, COMM.size, N, "float32")[COMM.rank])
    record = PairLayout(reducer.k, np.dtype("float32")).nbytes
    expected = 0 if gpu_topology.memory.cuda_aware else (COMM.size + 1) * record
    staged = reducer.last["bytes_staged"]
    assert_all(COMM, staged == expected, f"staged {staged} bytes, expected {expected}")
    assert_all(COMM, expected < N * 4, "the test's sizes no longer show the point")


@pytest.mark.mpi(min_size=1)
def test_mstopk_on_the_device_selects_what_the_cpu_does(gpu_topology):
    """The paper's selector, bisection kernels and all, inside hitopk."""
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer("hitopk", gpu_topology, N, "float32", density=DENSITY, selector="mstopk")
    ref = Reference("hitopk", p, gpu_topology.emulated_ranks_per_node, N, "float32", DENSITY)
    grads = integer_grads(7, 0, p, N, "float32")
    out = reducer.allreduce(grads[rank])
    assert_all(COMM, np.array_equal(out, ref.step(grads)), "mstopk on the device differs from the reference")


@pytest.mark.mpi(min_size=2)
def test_a_bad_gradient_on_one_rank_is_refused_on_every_rank(gpu_topology):
    """The device-side finiteness check and the kind check raise alike on
    every rank, and nothing changes: the next good call matches the reference."""
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer("hitopk", gpu_topology, N, "float32", density=DENSITY, selector="threshold")
    ref = Reference("hitopk", p, gpu_topology.emulated_ranks_per_node, N, "float32", DENSITY)
    grads = integer_grads(3, 0, p, N, "float32")
    poisoned = grads[rank].copy()
    if rank == p - 1:
        poisoned[5] = np.nan
    with pytest.raises(NonFiniteGradientError, match=f"rank {p - 1}: non-finite"):
        reducer.allreduce(poisoned)
    wrong = grads[rank].tolist() if rank == 0 else grads[rank]
    with pytest.raises(GradientError, match="rank 0: not a NumPy array .*standing for GPU memory"):
        reducer.allreduce(wrong)
    out = reducer.allreduce(grads[rank])
    assert_all(COMM, np.array_equal(out, ref.step(grads)), "a refused call changed the state")
