"""spar_comm.memory and the GPU choice of a topology, without a GPU: the
staging through host buffers, the adoption of foreign arrays through DLPack,
the GPU's record-by-record scatter-add, and the refusals of ``--device gpu``."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from mpi4py import MPI

from spar_comm import ConfigError, Topology
from spar_comm.device import open_memory
from spar_comm.kernels.sparse import add_records, scatter_add
from spar_comm.memory import HOST, SimulatedGpuMemory


@settings(max_examples=50, deadline=None)
@given(data=st.data(), records=st.integers(1, 6), k=st.integers(0, 20))
def test_the_record_by_record_add_gives_the_bits_of_add_at(data, records, k):
    """Positions distinct within a record, repeated across records: the GPU's
    loop over records must add in the same order as NumPy's add.at."""
    n = max(k, 1) + data.draw(st.integers(0, 10))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    indices = np.stack([rng.choice(n, k, replace=False) for _ in range(records)]).astype(np.int32)
    values = rng.standard_normal((records, k)).astype(np.float32) * np.float32(1e3)
    start = rng.standard_normal(n).astype(np.float32)
    assert np.array_equal(add_records(start.copy(), indices, values), scatter_add(start.copy(), indices, values))


def test_staging_copies_what_is_sent_out_and_what_is_received_in():
    memory = SimulatedGpuMemory(cuda_aware=False)
    send, recv = np.arange(6, dtype=np.float32), np.zeros(12, dtype=np.float32)
    with memory.for_mpi(send, recv) as (host_send, host_recv):
        assert host_send is not send and host_recv is not recv  # MPI never sees the "device" arrays
        assert np.array_equal(host_send, send) and host_recv.shape == recv.shape
        host_recv[...] = 7
        assert not recv.any()  # copied back only after the call
    assert (recv == 7).all()
    assert memory.staged_bytes(send, recv) == send.nbytes + recv.nbytes
    buf = np.ones(4, dtype=np.float64)  # in place: one buffer, copied out and back
    with memory.for_mpi(buf, buf) as (host_send, host_recv):
        assert host_send is host_recv
        host_recv *= 3
    assert (buf == 3).all() and memory.staged_bytes(buf, buf) == 2 * buf.nbytes
    with memory.for_mpi(None, recv) as (host_send, host_recv):  # receive only
        assert host_send is None
        host_recv[...] = 1
    assert (recv == 1).all()


def test_staging_buffers_are_reused_and_grow_in_powers_of_two():
    memory = SimulatedGpuMemory(cuda_aware=False)
    with memory.for_mpi(np.zeros(10, np.float32), None):
        pass
    first = memory._pinned[0]
    with memory.for_mpi(np.zeros(20, np.float32), None):
        pass
    assert memory._pinned[0] is first and first.size == 4096
    with memory.for_mpi(np.zeros(5000, np.float32), None):
        pass
    assert memory._pinned[0].size == 32768


def test_cuda_aware_mpi_reads_the_device_arrays_themselves():
    memory = SimulatedGpuMemory(cuda_aware=True)
    send, recv = np.ones(3), np.zeros(3)
    with memory.for_mpi(send, recv) as (host_send, host_recv):
        assert host_send is send and host_recv is recv
    assert memory.staged_bytes(send, recv) == 0


def test_a_foreign_array_is_adopted_through_dlpack_and_answered_in_its_own_kind():
    torch = pytest.importorskip("torch")
    memory = SimulatedGpuMemory(cuda_aware=False)
    tensor = torch.arange(5, dtype=torch.float32)
    array, back = memory.adopt(tensor)
    assert isinstance(array, np.ndarray)
    array[0] = 42  # zero-copy: the caller's memory
    assert tensor[0].item() == 42
    answer = back(array * 2)
    assert isinstance(answer, torch.Tensor) and answer.tolist() == [84, 2, 4, 6, 8]
    assert HOST.adopt(tensor)[0] is None  # the CPU path takes NumPy arrays only
    assert memory.adopt([1.0, 2.0])[0] is None


def test_device_selectors_exist_for_every_method_and_refuse_others():
    memory = SimulatedGpuMemory(cuda_aware=False)
    with pytest.raises(ValueError, match="unknown top-k method 'nonesuch'; known on the device"):
        memory.selector("nonesuch", {})
    with pytest.raises(ValueError):
        memory.selector("mstopk", {"N": 0})


def gpu_here() -> bool:
    """Whether CuPy sees a GPU, with the simulator off (``make test-gpu``)."""
    from numba import config

    try:
        import cupy

        return not config.ENABLE_CUDASIM and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or CUDARuntimeError without a driver or device
        return False


def test_gpu_without_cupy_or_a_gpu_is_a_config_error_naming_what_is_missing():
    if gpu_here():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="--device gpu: (No module named|no CUDA device is visible)"):
        Topology(MPI.COMM_SELF, device="gpu")


def test_an_unknown_device_is_refused():
    with pytest.raises(ConfigError, match="device must be one of cpu, gpu, gpu-simulator, got 'tpu'"):
        open_memory("tpu", MPI.COMM_SELF, 0)


def test_the_simulated_gpu_needs_the_simulator(monkeypatch):
    from numba import config

    monkeypatch.setattr(config, "ENABLE_CUDASIM", 0)
    with pytest.raises(ConfigError, match="--device gpu-simulator: it needs NUMBA_ENABLE_CUDASIM=1"):
        open_memory("gpu-simulator", MPI.COMM_SELF, 0)


def test_on_a_gpu_a_lone_rank_takes_gpu_0_and_answers_cupy_and_torch_in_kind():
    if not gpu_here():
        pytest.skip("needs CuPy, a GPU and NUMBA_ENABLE_CUDASIM=0")
    import cupy

    from spar_comm import make_allreducer

    topology = Topology(MPI.COMM_SELF, device="gpu")
    assert topology.memory.index == 0 and topology.memory.xp is cupy
    reducer = make_allreducer("topka", topology, 4096, density=0.01, selector="threshold")
    x = cupy.arange(4096, dtype=cupy.float32) - 2048
    out = reducer.allreduce(x)
    kept = cupy.asnumpy(cupy.flatnonzero(out))
    assert isinstance(out, cupy.ndarray) and kept.tolist() == list(range(21)) + list(range(4096 - 20, 4096))
    torch = pytest.importorskip("torch")
    tensor = torch.ones(4096, device="cuda")
    answer = reducer.allreduce(tensor)
    assert isinstance(answer, torch.Tensor) and answer.is_cuda


def test_a_topology_names_its_memory():
    from numba import config

    if not config.ENABLE_CUDASIM:
        pytest.skip("the simulated GPU needs NUMBA_ENABLE_CUDASIM=1")
    topology = Topology(MPI.COMM_SELF, device="gpu-simulator")
    assert topology.memory.name == "gpu-simulator" and topology.memory.index == 0
    assert "gpu-simulator 0" in topology.describe()
    assert Topology(MPI.COMM_SELF).memory is HOST
