"""DistributedOptimizer's GPU path. CI has no GPU: under ``gpu-simulator`` the
optimizer runs the code it runs on CUDA tensors (buckets in the allreducers'
device memory, the device kernels, staging, the stream layer) on CPU tensors,
with the stream and event operations doing nothing, and must give the CPU
path's bits: every algorithm, overlap on and off, and a resume. With
``NUMBA_ENABLE_CUDASIM=0`` on a GPU machine the same tests run on CUDA tensors.

The simulator is slow: under it this runs at 3 ranks only (nodes of 2 and
1 in ``make test``: the uneven layout, and a rank alone on its node), at the
launch's node layout, on a small model for few steps; on a GPU at any size."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")

import spar_comm.torch as sct  # noqa: E402
from mpi_helpers import assert_all, assert_identical_bits  # noqa: E402
from spar_comm import ConfigError, NonFiniteGradientError, Topology  # noqa: E402
from spar_comm.torch.streams import CudaStreams, NoStreams, tensor_device  # noqa: E402
from numba import config as numba_config  # noqa: E402
from test_gpu_path_mpi import gpu_device  # noqa: E402
from reference import reproducible  # noqa: E402
from test_torch_mpi import Controlled, make_run, rank_grads, train_steps  # noqa: E402

COMM = MPI.COMM_WORLD
torch.set_num_threads(1)
pytestmark = [pytest.mark.worlds(3), pytest.mark.usefixtures("fast_simulator")]


@pytest.fixture(scope="module")
def topologies():
    """The CPU path and the GPU path (simulated, or the real one) over the same ranks."""
    cpu, gpu = Topology(), Topology(device=gpu_device())
    yield cpu, gpu
    cpu.free()
    gpu.free()


def place(model, topology):
    return model.to(tensor_device(topology.memory))


def wrap(model, topology, **options):
    options.setdefault("bucket_cap_mb", 40 * 4 / 2**20)  # about 40 floats: several buckets
    return sct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9),
                                    model.named_parameters(), topology=topology, **options)


def backward_with(model, grads) -> None:
    """``Controlled.backward_with`` on the model's device."""
    sum((p * torch.from_numpy(g).to(p.device).reshape(p.shape)).sum() for p, g in zip(model.ps, grads)).backward()


def host_flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().flatten().cpu() for t in tensors]).numpy()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", reproducible())  # powersgd's products round otherwise on a GPU
def test_the_gpu_path_gives_the_cpu_paths_bits(topologies, algorithm):
    """Gradients after every synchronize, weights after every step and the
    residuals they leave, to the bit, with buckets reduced during backward
    (overlap) and at step() (mstopk on the device and on the CPU)."""
    cpu, gpu = topologies
    runs = []
    for topology, overlap in [(cpu, True), (gpu, True), (gpu, False)]:
        model = place(Controlled(), topology)
        runs.append((model, wrap(model, topology, algorithm=algorithm, density=0.2, overlap=overlap)))
    streams = CudaStreams if gpu_device() == "gpu" else NoStreams
    assert_all(COMM, all(type(opt._streams) is streams for _, opt in runs[1:]), "not the device's streams")
    assert_all(COMM, runs[1][1].buckets[0].reducer.memory.name == gpu_device(), "not on the GPU path")
    assert_all(COMM, len(runs[1][1].buckets) >= 2, f"{len(runs[1][1].buckets)} buckets")
    for step in range(2):
        grads = rank_grads(13, step)
        seen = []
        for model, opt in runs:
            opt.zero_grad()
            backward_with(model, grads[COMM.rank])
            opt.synchronize()
            with opt.skip_synchronize():
                opt.step()
            seen.append((host_flat(p.grad for p in model.ps), host_flat(model.ps),
                         [b.reducer.memory.to_host(b.reducer.residual_full()) for b in opt.buckets]))
        (cpu_grad, cpu_w, cpu_res), *on_gpu = seen
        for mode, (grad, w, res) in zip(["overlap", "at step()"], on_gpu):
            assert_all(COMM, np.array_equal(cpu_grad, grad), f"{mode}, step {step}: reduced gradients differ")
            assert_all(COMM, np.array_equal(cpu_w, w), f"{mode}, step {step}: weights differ")
            assert_all(COMM, all(np.array_equal(a, b) for a, b in zip(cpu_res, res)), f"{mode}, step {step}: residuals")
        assert_identical_bits(COMM, on_gpu[0][1], "weights")


@pytest.mark.mpi(min_size=1)
def test_a_resume_on_the_gpu_path_gives_the_bits_of_a_run_that_never_stopped(topologies):
    cpu, gpu = topologies
    net, opt = make_run(gpu)
    train_steps(net, opt, range(3))
    straight = host_flat(net.parameters())

    net, opt = make_run(gpu)
    train_steps(net, opt, range(1))
    saved_model, saved_opt = net.state_dict(), opt.state_dict()
    net, opt = make_run(gpu, seed=1)
    net.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    train_steps(net, opt, range(1, 3))
    resumed = host_flat(net.parameters())
    assert_all(COMM, np.array_equal(straight, resumed), "resumed run differs from the one that never stopped")

    assert_identical_bits(COMM, resumed, "parameters")
    if numba_config.ENABLE_CUDASIM:  # on a GPU the model's own arithmetic (cuBLAS) rounds otherwise than the CPU's
        net, opt = make_run(cpu)  # and the CPU path's run to the bit
        train_steps(net, opt, range(3))
        assert_all(COMM, np.array_equal(straight, host_flat(net.parameters())), "the CPU path's run differs")


@pytest.mark.mpi(min_size=2)
def test_a_nan_on_one_rank_is_refused_on_every_rank_on_the_gpu_path(topologies):
    _, gpu = topologies
    model = place(Controlled(), gpu)
    opt = wrap(model, gpu, algorithm="hitopk", density=0.2, non_finite="raise")
    grads = rank_grads(2, 0)
    if COMM.rank == COMM.size - 1:
        grads[COMM.rank][3][1] = np.nan
    backward_with(model, grads[COMM.rank])
    with pytest.raises(NonFiniteGradientError, match=f"rank {COMM.size - 1}"):
        opt.step()
    assert_all(COMM, all(not p.detach().any() for p in model.ps), "parameters changed by a refused step")


@pytest.mark.mpi(min_size=2)
def test_parameters_where_the_topology_does_not_work_are_refused_on_every_rank(topologies):
    """One rank's model elsewhere (the meta device stands for a wrong device, as
    no GPU is at hand), or on two devices: ConfigError on every rank, no hang."""
    _, gpu = topologies
    odd = COMM.rank == COMM.size - 1
    model = Controlled().to("meta" if odd else tensor_device(gpu.memory))
    with pytest.raises(ConfigError, match=f"rank {COMM.size - 1}: parameter 'ps.0' is on meta"):
        wrap(model, gpu)
    mixed = Controlled()
    if odd:
        mixed.ps[2] = torch.nn.Parameter(torch.zeros(mixed.ps[2].shape, device="meta"))
    with pytest.raises(ConfigError, match=r"several devices \(cpu, meta\)"):
        wrap(mixed, None)


@pytest.mark.mpi(min_size=2)
def test_an_overflow_under_autocast_is_skipped_on_every_rank_with_the_cpu_paths_bits(topologies):
    """GradScaler and autocast (float16 on a GPU, bfloat16 on the CPU that the
    simulator runs on), an overflow on rank 0 at step 1: skipped on every rank
    with the scale halved, and the GPU path ends on the CPU path's bits."""
    runs = []
    for topology in topologies:
        device = "cuda" if tensor_device(topology.memory).type == "cuda" else "cpu"
        model = place(Controlled(), topology)
        scaler = torch.amp.GradScaler(device, init_scale=2.0**10, growth_interval=1000)
        opt = wrap(model, topology, algorithm="hitopk", density=0.2, grad_scaler=scaler)
        for step in range(3):
            grads = rank_grads(5, step)[COMM.rank]
            if step == 1 and COMM.rank == 0:
                grads[3][1] = np.inf
            opt.zero_grad()
            before = host_flat(model.ps), scaler.get_scale()
            with torch.autocast(device, dtype=torch.float16 if device == "cuda" else torch.bfloat16):
                loss = sum((p * torch.from_numpy(g).to(p.device).reshape(p.shape)).sum() for p, g in zip(model.ps, grads))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            if step == 1:
                assert_all(COMM, scaler.get_scale() == before[1] / 2, f"{device}: scale {scaler.get_scale()}")
                assert_all(COMM, np.array_equal(host_flat(model.ps), before[0]), f"{device}: a skipped step moved")
        assert_identical_bits(COMM, host_flat(model.ps), "parameters")
        runs.append(host_flat(model.ps))
    assert_all(COMM, np.array_equal(*runs), "the GPU path's parameters differ from the CPU path's")
