"""The GPU path of every allreducer. CI runs it without a GPU: the topology's
``gpu-simulator`` memory stands NumPy arrays in for device memory and runs the
device kernels (selection, and gtopk's merge) under numba-cuda's simulator.
With ``NUMBA_ENABLE_CUDASIM=0`` on a machine with CuPy and a GPU the same
tests run on ``--device gpu``, CuPy arrays, ranks sharing the GPUs. Both
hand-offs to MPI are covered: pinned-host staging, and CUDA-aware (on a real
GPU only where the MPI library says it is, since any other may crash).

The simulator is slow, so this runs at one node layout per world size (the
launch's ``SPAR_COMM_RANKS_PER_NODE``) and on small vectors."""
from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

device_select = pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")

from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits# noqa: E402
from reference import Reference, reproducible  # noqa: E402
from spar_comm import GradientError, NonFiniteGradientError, Topology, make_allreducer  # noqa: E402
from spar_comm.collectives.pairs import PairLayout  # noqa: E402
from spar_comm.device import ENV_CUDA_AWARE, library_cuda_support  # noqa: E402
from test_collectives_mpi import integer_grads  # noqa: E402

COMM = MPI.COMM_WORLD
pytestmark = pytest.mark.usefixtures("fast_simulator")
N, DENSITY = 300, 0.02
MODES = {"staged": "0", "cuda-aware": "1"}


def gpu_device() -> str:
    """``gpu-simulator`` under the simulator, else ``gpu`` (skipped without CuPy and a GPU)."""
    from numba import config

    if config.ENABLE_CUDASIM:
        return "gpu-simulator"
    cupy = pytest.importorskip("cupy")
    try:
        cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        pytest.skip("no CUDA device, and the simulator is off")
    return "gpu"


@pytest.fixture(scope="module", params=list(MODES))
def gpu_topology(request):
    """A topology on the GPU (or the simulated one); ``request.param`` picks the MPI hand-off."""
    device = gpu_device()
    if device == "gpu" and request.param == "cuda-aware" and not library_cuda_support():
        pytest.skip("this MPI library is not CUDA-aware")
    patch = pytest.MonkeyPatch()
    patch.setenv(ENV_CUDA_AWARE, MODES[request.param])
    topology = Topology(device=device)
    patch.undo()
    yield topology
    topology.free()


def on_device(topology, array: np.ndarray):
    return topology.memory.xp.array(array)  # a copy: the tests reduce in place


def on_host(topology, array) -> np.ndarray:
    return topology.memory.to_host(array)


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", [pytest.param(a, marks=() if a in ("dense", "hitopk") else pytest.mark.slow)
                                       for a in reproducible()])  # the quick tier: one dense, one sparse
def test_the_gpu_path_matches_the_serial_reference(gpu_topology, algorithm):
    """Result and residual to the last bit, identical on every rank, in a
    fresh output and in place (``out=grad``)."""
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, gpu_topology, N, "float32", density=DENSITY, selector="threshold")
    ref = Reference(algorithm, p, gpu_topology.emulated_ranks_per_node, N, "float32", DENSITY)
    for step in range(2):
        grads = integer_grads(N, step, p, N, "float32")
        grad = on_device(gpu_topology, grads[rank])
        out = reducer.allreduce(grad, out=grad) if step else reducer.allreduce(grad)
        assert_all(COMM, (out is grad) == bool(step) and gpu_topology.memory.is_array(out), "not the array asked for")
        out = on_host(gpu_topology, out)
        expected = ref.step(grads)
        assert_all(COMM, np.array_equal(out, expected), f"step {step}: output differs from the reference")
        residual = on_host(gpu_topology, reducer.residual_full())
        assert_all(COMM, np.array_equal(residual, ref.residuals[rank]), f"step {step}: residual")
        assert_identical_bits(COMM, out, "output")
    reducer.free()


@pytest.mark.openmpi
@pytest.mark.mpi(min_size=2)
def test_staging_moves_the_pairs_not_the_vector(gpu_topology):
    """topka stages its k pairs out and the p records in: (p + 1) records, a
    few hundred bytes, against 1,200 for the vector; CUDA-aware stages nothing."""
    reducer = make_allreducer("topka", gpu_topology, N, "float32", density=DENSITY, selector="threshold")
    assert isinstance(reducer.topk.selector, device_select.DeviceThreshold)  # the device kernels select
    reducer.allreduce(on_device(gpu_topology, integer_grads(N, 0, COMM.size, N, "float32")[COMM.rank]))
    record = PairLayout(reducer.topk.k_most, np.dtype("float32")).nbytes
    expected = 0 if gpu_topology.memory.cuda_aware else (COMM.size + 1) * record
    staged = reducer.last["bytes_staged"]
    assert_all(COMM, staged == expected, f"staged {staged} bytes, expected {expected}")
    assert_all(COMM, expected < N * 4, "the test's sizes no longer show the point")


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
def test_mstopk_on_the_device_selects_what_the_cpu_does(gpu_topology):
    """The paper's selector, bisection kernels and all, inside hitopk."""
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer("hitopk", gpu_topology, N, "float32", density=DENSITY, selector="mstopk")
    ref = Reference("hitopk", p, gpu_topology.emulated_ranks_per_node, N, "float32", DENSITY)
    grads = integer_grads(7, 0, p, N, "float32")
    out = on_host(gpu_topology, reducer.allreduce(on_device(gpu_topology, grads[rank])))
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
        reducer.allreduce(on_device(gpu_topology, poisoned))
    wrong = grads[rank].tolist() if rank == 0 else on_device(gpu_topology, grads[rank])
    with pytest.raises(GradientError, match=f"rank 0: not {re.escape(gpu_topology.memory.kind)}"):
        reducer.allreduce(wrong)
    out = on_host(gpu_topology, reducer.allreduce(on_device(gpu_topology, grads[rank])))
    assert_all(COMM, np.array_equal(out, ref.step(grads)), "a refused call changed the state")


@pytest.mark.mpi(min_size=2)
def test_emulated_nodes_on_one_host_spread_over_all_its_gpus(monkeypatch):
    """The GPU is picked by the rank's place on its host, not in its emulated
    node: one rank per emulated node must not put every rank on GPU 0."""
    from spar_comm import topology as topology_module
    from spar_comm.memory import HOST

    asked = []
    monkeypatch.setattr(topology_module, "open_memory", lambda device, comm, host_rank: asked.append(host_rank) or HOST)
    topology = Topology(ranks_per_node=1)
    assert_all(COMM, asked == [COMM.rank] and topology.local_rank == 0, f"asked for GPU of host rank {asked}")
    topology.free()
