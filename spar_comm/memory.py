"""Where a rank's arrays live, and how they reach MPI.

An allreducer works in one memory: ``HOST`` (NumPy arrays, handed to MPI as
they are) or the rank's GPU (``GpuMemory``: CuPy arrays). The algorithms are
written once against ``memory.xp``; what differs between memories lives here:

* what a caller's array must be, and the adoption of a foreign one (a CUDA
  torch tensor) through DLPack, zero-copy, its result handed back in the
  caller's own kind of array;
* selection on the device (``kernels.device_select``), and the finiteness
  check as a reduction on the device;
* the hand-off to MPI. A CUDA-aware MPI reads device buffers in place once
  the stream has finished writing them (mpi4py does not synchronise). Any
  other MPI gets them through pinned host buffers: each call copies in what
  it sends and out what it receives, so a sparse algorithm moves its k
  pairs, never the whole vector (``.last["bytes_staged"]`` counts them);
* the clock: the stream is synchronised before each timestamp, so phase
  times are the GPU's, not the launch queue's.

``SimulatedGpuMemory`` runs the GPU path with NumPy arrays standing for device
memory and the device kernels under numba-cuda's CUDA simulator
(``NUMBA_ENABLE_CUDASIM=1``): slow, but it is how CI, with no GPU, runs the
staging, the device checks and the kernels inside every algorithm.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import numpy as np

from . import kernels

#: The devices a run may name: ``gpu-simulator`` is the GPU path on the CPU.
DEVICES = ("cpu", "gpu", "gpu-simulator")


def _same(x: Any) -> Any:
    return x


class HostMemory:
    """NumPy arrays in host memory: MPI takes them as they are."""

    name = "cpu"
    xp: Any = np
    #: Whether MPI reads this memory in place (nothing staged).
    cuda_aware = True
    #: What a caller's gradient must be (for the refusal's message).
    kind = "a NumPy array"
    #: Whether arrays are in host memory (which a node's shared window can hold).
    in_host_memory = True

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def adopt(self, x: Any) -> Tuple[Optional[Any], Callable[[Any], Any]]:
        """``x`` as an array of this memory (None when it cannot be), and the
        conversion of a result back to the caller's kind of array."""
        return (x if self.is_array(x) else None), _same

    def all_finite(self, x: Any) -> bool:
        return kernels.all_finite(x)

    def selector(self, method: str, options: Dict[str, Any]) -> kernels.Selector:
        """A fresh selector of ``method`` that works on this memory's arrays."""
        return kernels.make_selector(method, **options)

    def now(self) -> float:
        """A timestamp taken once everything queued before it has run."""
        return time.perf_counter()

    @contextmanager
    def for_mpi(self, send: Any, recv: Any) -> Iterator[Tuple[Any, Any]]:
        """``(send, recv)`` as MPI may take them; either may be None (nothing to
        send or receive), or both the same array (in place)."""
        yield send, recv

    def staged_bytes(self, send: Any, recv: Any) -> int:
        """Bytes ``for_mpi`` copies between device and host for this pair."""
        return 0

    def to_host(self, x: Any) -> np.ndarray:
        """A NumPy copy of ``x`` (for checkpoints)."""
        return np.array(x)

    def describe(self) -> str:
        return "cpu"


#: The memory of every CPU allreducer.
HOST = HostMemory()


class GpuMemory(HostMemory):
    """CuPy arrays on GPU ``index``; MPI reads them in place when ``cuda_aware``,
    else through pinned host buffers."""

    name = "gpu"
    kind = "a CuPy array (or a CUDA array exporting DLPack) on this rank's GPU"
    in_host_memory = False

    def __init__(self, index: int, cuda_aware: bool):
        import cupy

        self.xp = cupy
        self.index = index
        self.cuda_aware = cuda_aware
        cupy.cuda.Device(index).use()
        self._pinned: Dict[int, np.ndarray] = {}  # slot (0 send, 1 receive) -> bytes

    # -- what the GPU path needs of a device -------------------------------------------
    def is_array(self, x: Any) -> bool:
        return isinstance(x, self.xp.ndarray) and x.device.id == self.index

    def synchronize(self) -> None:
        self.xp.cuda.get_current_stream().synchronize()

    def new_pinned(self, nbytes: int) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned(nbytes, dtype=np.uint8)

    def download(self, device: Any, host: np.ndarray) -> None:
        device.get(out=host)  # blocking: the host buffer is ready afterwards

    def upload(self, host: np.ndarray, device: Any) -> None:
        device.set(host)
        self.synchronize()  # the pinned buffer is reused by the next call

    def to_host(self, x: Any) -> np.ndarray:
        return self.xp.asnumpy(x)

    # -- built on those -----------------------------------------------------------------
    def adopt(self, x: Any) -> Tuple[Optional[Any], Callable[[Any], Any]]:
        if self.is_array(x):
            return x, _same
        if isinstance(x, self.xp.ndarray) or not hasattr(x, "__dlpack__"):
            return None, _same  # a CuPy array on another GPU, or no device array at all
        try:
            array = self.xp.from_dlpack(x)
        except Exception:  # another device, a read-only or strided export: refused below
            return None, _same
        if not self.is_array(array):
            return None, _same
        import array_api_compat

        return array, array_api_compat.array_namespace(x).from_dlpack

    def all_finite(self, x: Any) -> bool:
        return bool(self.xp.isfinite(x).all())  # a reduction on the device, one flag back

    def selector(self, method: str, options: Dict[str, Any]) -> kernels.Selector:
        return kernels.make_selector(method, device=True, **options)

    def now(self) -> float:
        self.synchronize()
        return time.perf_counter()

    @contextmanager
    def for_mpi(self, send: Any, recv: Any) -> Iterator[Tuple[Any, Any]]:
        if self.cuda_aware:
            self.synchronize()  # MPI reads device memory: the kernels writing it must be done
            yield send, recv
            return
        host_send = self._staging(0, send)
        if send is not None:
            self.download(send, host_send)
        host_recv = host_send if recv is send else self._staging(1, recv)
        yield host_send, host_recv
        if recv is not None:
            self.upload(host_recv, recv)

    def staged_bytes(self, send: Any, recv: Any) -> int:
        if self.cuda_aware:
            return 0
        return sum(0 if a is None else a.nbytes for a in (send, recv))

    def _staging(self, slot: int, like: Any) -> Optional[np.ndarray]:
        """A pinned host array shaped like ``like``; the slot grows by powers of two."""
        if like is None:
            return None
        buf = self._pinned.get(slot)
        if buf is None or buf.size < like.nbytes:
            buf = self._pinned[slot] = self.new_pinned(1 << max(12, (like.nbytes - 1).bit_length()))
        return buf[: like.nbytes].view(like.dtype).reshape(like.shape)

    def describe(self) -> str:
        how = "CUDA-aware MPI" if self.cuda_aware else "MPI through pinned host buffers"
        return f"{self.name} {self.index}, {how}"


class SimulatedGpuMemory(GpuMemory):
    """The GPU path on the CPU: NumPy arrays stand for device memory, and the
    device kernels run under numba-cuda's simulator. For CI and debugging."""

    name = "gpu-simulator"
    kind = "a NumPy array (or an array exporting DLPack), standing for GPU memory"

    def __init__(self, cuda_aware: bool):
        self.xp = np
        self.index = 0
        self.cuda_aware = cuda_aware
        self._pinned = {}

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def synchronize(self) -> None:
        pass

    def new_pinned(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, dtype=np.uint8)

    def download(self, device: Any, host: np.ndarray) -> None:
        host[...] = device

    def upload(self, host: np.ndarray, device: Any) -> None:
        device[...] = host

    def to_host(self, x: Any) -> np.ndarray:
        return np.array(x)
