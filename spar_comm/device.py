"""Whether the MPI library takes GPU memory, and which GPU a rank uses.

mpi4py passes a CuPy array's device pointer straight to MPI, but only a
CUDA-aware MPI can read it; any other library may crash on it. mpi4py has no
call that says which kind it loaded, so the library itself is asked through
ctypes: Open MPI answers ``MPIX_Query_cuda_support()``, MPICH 4 and later
``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``. A library with
neither is taken as not CUDA-aware. ``SPAR_COMM_CUDA_AWARE=0|1`` overrides the
answer (a site whose MPI answers wrongly, or a test). Every rank must agree,
so the job uses device buffers only when all of its ranks can.

One GPU per rank: the rank's place among the ranks of its host picks GPU
``host_rank % device_count``.
``open_memory`` makes that choice for a topology, collectively.
"""
from __future__ import annotations

import ctypes
import os
from typing import Optional

from mpi4py import MPI

from .consensus import raise_if_any
from .errors import ConfigError
from .memory import DEVICES, HOST, GpuMemory, HostMemory, SimulatedGpuMemory

ENV_CUDA_AWARE = "SPAR_COMM_CUDA_AWARE"
#: MPICH's mpi.h: ``#define MPIX_GPU_SUPPORT_CUDA (0)``.
MPIX_GPU_SUPPORT_CUDA = 0


def mpi_library_path() -> Optional[str]:
    """The file of the MPI library this process loaded (mpi4py's), from /proc/self/maps."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "/lib" in line and "mpi" in line.rsplit("/", 1)[-1]}
    except OSError:
        return None
    named = sorted(p for p in paths if os.path.basename(p).startswith(("libmpi.", "libmpi_", "libmpich")))
    return named[0] if named else None


def library_cuda_support(library: Optional[ctypes.CDLL] = None) -> Optional[bool]:
    """What the loaded MPI library says of CUDA support; None when it has no call to ask."""
    if library is None:
        path = mpi_library_path()
        if path is None:
            return None
        library = ctypes.CDLL(path)
    query = getattr(library, "MPIX_GPU_query_support", None)
    if query is not None:
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        query.restype = ctypes.c_int
        flag = ctypes.c_int(0)
        return query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0 and flag.value == 1
    query = getattr(library, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.argtypes = []
        query.restype = ctypes.c_int
        return query() == 1
    return None


def local_cuda_aware(transport: Optional[bool] = None) -> bool:
    """This rank's answer: ``SPAR_COMM_CUDA_AWARE`` when set, else the
    transport's (``transport``: a torch group's backend says), else the MPI
    library's. Raises ConfigError for a value of the variable other than 0 or 1."""
    text = os.environ.get(ENV_CUDA_AWARE, "").strip()
    if text:
        if text not in ("0", "1"):
            raise ConfigError(f"{ENV_CUDA_AWARE} must be 0 or 1, got {text!r}")
        return text == "1"
    return transport if transport is not None else bool(library_cuda_support())


def cuda_aware(comm: MPI.Comm) -> bool:
    """Whether every rank of ``comm`` may hand device buffers to its transport
    (MPI, or a torch group: NCCL takes them, gloo does not). Collective: a bad
    ``SPAR_COMM_CUDA_AWARE`` on any rank is a ConfigError on every rank;
    otherwise the answer is the same on every rank (all must be CUDA-aware)."""
    try:
        mine, problem = local_cuda_aware(getattr(comm, "cuda_aware", None)), None
    except ConfigError as error:
        mine, problem = False, str(error)
    raise_if_any(comm, problem)
    return bool(comm.allreduce(int(mine), op=MPI.MIN))


def device_index(host_rank: int, device_count: int) -> int:
    """The GPU of a rank: ``host_rank % device_count`` (ranks share GPUs round-robin)."""
    if device_count < 1:
        raise ConfigError("no CUDA device is visible to this rank")
    return host_rank % device_count


def _local_gpu(device: str, host_rank: int) -> int:
    """This rank's GPU for ``device`` ("gpu": CuPy's, "gpu-simulator": 0), or
    ConfigError naming what is missing."""
    if device == "gpu-simulator":
        try:
            from numba import config
            from .kernels import device_select  # noqa: F401  (needs numba-cuda)
        except ImportError as error:
            raise ConfigError(f"numba-cuda is not installed ({error})") from None
        if not config.ENABLE_CUDASIM:
            raise ConfigError("it needs NUMBA_ENABLE_CUDASIM=1 in the environment at start")
        return 0
    try:
        import cupy
        from .kernels import device_select  # noqa: F401  (needs numba-cuda)
    except ImportError as error:
        raise ConfigError(f"{error} (pip install 'spar_comm[gpu]')") from None
    from numba import config

    if config.ENABLE_CUDASIM:
        raise ConfigError("NUMBA_ENABLE_CUDASIM is set: the device kernels would run in the simulator")
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CUDARuntimeError when no driver or no device
        raise ConfigError(f"no CUDA device is visible to this rank ({error})") from None
    return device_index(host_rank, count)


def open_memory(device: str, comm: MPI.Comm, host_rank: int) -> HostMemory:
    """The memory a rank's allreducers work in: host memory for ``cpu``, GPU
    ``host_rank % device_count`` for ``gpu`` (``host_rank``: the rank's place
    among the ranks of its host). Collective: a rank without a GPU (or CuPy)
    raises ConfigError on every rank, and every rank agrees on whether MPI is
    CUDA-aware."""
    problem = None if device in DEVICES else f"device must be one of {', '.join(DEVICES)}, got {device!r}"
    index = 0
    if problem is None and device != "cpu":
        try:
            index = _local_gpu(device, host_rank)
        except ConfigError as error:
            problem = f"--device {device}: {error}"
    raise_if_any(comm, problem)
    if device == "cpu":
        return HOST
    aware = cuda_aware(comm)
    return GpuMemory(index, aware) if device == "gpu" else SimulatedGpuMemory(aware)
