"""The loop's one door to MPI and to the host: the array namespace of a
device, the fused gradient allreduce, and the small collectives of a step.

On the CPU the allreducers take NumPy arrays, and a gradient of another
framework crosses to the host here (zero-copy for CPU torch). On a GPU they
take the device arrays themselves (CuPy, or CUDA torch tensors through
DLPack), so a gradient never leaves the device but for what MPI must move.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple

import array_api_compat
import numpy as np
from mpi4py import MPI

from .. import waiting
from ..costmodel.auto import make_allreducer
from ..memory import HostMemory
from ..topology import Topology


def array_backend(memory: HostMemory) -> Tuple[Any, Any]:
    """(array namespace, device object) of a memory: NumPy's on the CPU (and
    the simulated GPU), CuPy's on the rank's GPU."""
    probe = memory.xp.zeros(0)
    return array_api_compat.array_namespace(probe), array_api_compat.device(probe)


def to_host(x: Any) -> np.ndarray:
    """A NumPy view of ``x`` (a copy only when ``x`` is off the host)."""
    return np.asarray(array_api_compat.to_device(x, "cpu"))


class Group:
    """The ranks of a run: fused allreduce of the gradient and tiny collectives."""

    def __init__(self, topology: Topology):
        self.topology = topology
        self.comm: MPI.Comm = topology.world
        self.rank, self.size = self.comm.rank, self.comm.size
        self._flag = np.zeros(1, dtype=np.int32)

    def allreducer(self, algorithm: str, size: int, dtype: str, density: float, selector: str,
                   options: Optional[dict] = None) -> "FusedAllreduce":
        """``options``: further settings of ``make_allreducer`` (codecs, an algorithm's own)."""
        return FusedAllreduce(make_allreducer(algorithm, self.topology, size, dtype, density, selector, **(options or {})))

    def broadcast(self, x: Any, xp: Any) -> None:
        """Overwrite ``x`` in place with rank 0's bits."""
        host = np.ascontiguousarray(to_host(x))
        waiting.collective(self.comm, "Bcast", host, root=0, nbytes=host.nbytes)
        x[...] = xp.asarray(host, device=array_api_compat.device(x))

    def sum(self, values: Sequence[float]) -> np.ndarray:
        """Elementwise sum over ranks of a few float64 figures."""
        buf = np.asarray(values, dtype=np.float64)
        waiting.collective(self.comm, "Allreduce", MPI.IN_PLACE, buf, op=MPI.SUM)
        return buf

    def any_flags(self, flags: int) -> int:
        """The bitwise OR of every rank's ``flags``: how ranks agree on local events."""
        self._flag[0] = flags
        waiting.collective(self.comm, "Allreduce", MPI.IN_PLACE, self._flag, op=MPI.BOR)
        return int(self._flag[0])


class FusedAllreduce:
    """One allreduce call per step on the flat gradient buffer, in place.

    The result is written back into the buffer, so views of it (a torch
    module's ``.grad``) hold the averaged gradient afterwards, as in DDP.
    """

    def __init__(self, reducer: Any):
        self.reducer = reducer

    @property
    def last(self) -> dict:
        return self.reducer.last

    @property
    def sparse(self) -> bool:
        """Whether the algorithm selects (dense ones ignore selector and density)."""
        return self.reducer.sparse

    def __call__(self, grad: Any, xp: Any, density: Optional[float] = None) -> Any:
        """``density``: this call's (``Allreducer.allreduce``)."""
        if not self.reducer.memory.in_host_memory:  # a device array, adopted as it is
            self.reducer.allreduce(grad, out=grad, density=density)
            return grad
        host = to_host(grad)
        self.reducer.allreduce(host, out=host, density=density)  # in place: no new array per step
        if host is not grad:  # a framework tensor off the host: write the result back
            grad[...] = xp.asarray(host, device=array_api_compat.device(grad))
        return grad

    def residual(self, copy: bool = True) -> Tuple[Tuple[int, int], np.ndarray]:
        """This rank's error-feedback residual: its global range and values
        (``copy=False``: on the host, the values themselves)."""
        return self.reducer.residual_state(copy)

    def load_residual(self, span: Tuple[int, int], values: np.ndarray) -> None:
        """Restore a residual saved by ``residual()`` on the same rank and layout."""
        self.reducer.load_residual_state(span, values)

    def shared_state(self) -> Optional[np.ndarray]:
        """State every rank holds alike (PowerSGD's Q), or None."""
        return self.reducer.shared_state()

    def load_shared_state(self, values: np.ndarray) -> None:
        self.reducer.load_shared_state(values)
