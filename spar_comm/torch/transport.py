"""A ``torch.distributed`` process group behind the communicator interface the
rest of spar_comm speaks: mpi4py's, the part of it the topology, the checks
and ``Channel`` use.

So every allreducer runs over a torch job's own group (gloo; NCCL on CUDA
tensors) on the same code as over MPI, and never learns which it runs on.
NumPy arrays reach torch without a copy (``torch.from_numpy``; a byte view
where the collective only moves data). What torch lacks is built from what
it has: an Allgatherv from an Allgather of blocks padded to the longest, a
Sendrecv from ``isend`` and ``irecv`` (on NCCL, one ``batch_isend_irecv``),
``Split`` from an Allgather of the colours and one ``new_group`` a colour.
torch names a group by a counter that every rank of the job must step
alike (a group made by its members alone is named by how many groups each
member already has, which differs between ranks), so every rank makes
every colour's group, in colour order: a comm splits only when it spans
the whole job, or when it is one part of a partition of the job split
from it (every rank in one part), all of whose parts split at once, as the
replica groups of sharded data parallel do at start-up (``fsdp.py``). The nonblocking forms complete at once: gloo waits without
spinning, and NCCL's work is ordered on the device. Nodes (``Split_type``)
are torchrun's groups (``GROUP_RANK``) where set, else the hosts' names.

The node's shared-memory windows, which MPI would make, are files in
/dev/shm named through the group (``collectives/windows.py``), where the
node's ranks name one host.

Device arrays (CuPy's) reach torch as CUDA tensors, without a copy. Each call
puts its tensors where the group's backend takes them: NCCL takes device
memory only (a host buffer, such as a check's verdicts, crosses to the device
and back), gloo host memory, and device memory in its collectives but not in
``isend``/``irecv`` (a CUDA tensor there breaks the group: it crosses to the
host). Work on device tensors is queued on CuPy's current stream, so it comes
after the kernels that wrote the buffers and before those that read them.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from ..errors import ConfigError
from ..mpi_strings import processor_name

#: mpi4py's reduction operations (by handle: they do not hash), as torch names
#: them (buffers) and as Python folds them (objects).
_OPS = {MPI.SUM.py2f(): dist.ReduceOp.SUM, MPI.MIN.py2f(): dist.ReduceOp.MIN, MPI.MAX.py2f(): dist.ReduceOp.MAX,
        MPI.BOR.py2f(): dist.ReduceOp.BOR, MPI.BAND.py2f(): dist.ReduceOp.BAND}
_FOLDS = {MPI.SUM.py2f(): sum, MPI.MIN.py2f(): min, MPI.MAX.py2f(): max}
#: The bitwise operations, folded over an Allgather where the backend lacks them (NCCL).
_BITWISE = {MPI.BOR.py2f(): torch.bitwise_or, MPI.BAND.py2f(): torch.bitwise_and}


def fold_bitwise(rows: torch.Tensor, op: Any) -> torch.Tensor:
    """``op`` (MPI.BOR or MPI.BAND) over the rows of ``rows``, one a rank."""
    return functools.reduce(_BITWISE[op.py2f()], rows.unbind(0))


def _is_device(buf: Any) -> bool:
    array = buf[0] if isinstance(buf, (list, tuple)) else buf
    return hasattr(array, "__cuda_array_interface__") and not isinstance(array, torch.Tensor)


def _tensor(buf: Any) -> torch.Tensor:
    """A NumPy or CuPy array (or mpi4py's ``[array, count, datatype]``) as a
    tensor sharing its memory: its own dtype where torch has it, else bytes.
    ValueError for an array that is not contiguous, as mpi4py gives: a copy
    would lose what the call writes."""
    array = buf[0] if isinstance(buf, (list, tuple)) else buf
    if hasattr(array, "flags") and not array.flags.c_contiguous:
        raise ValueError("spar_comm's torch transport takes contiguous buffers only")
    if isinstance(buf, (list, tuple)):
        array = array if _is_device(array) else np.asarray(array)
        return _tensor(array.reshape(-1).view(np.uint8)[:buf[1]])
    if _is_device(buf):
        return torch.as_tensor(buf.reshape(-1), device=torch.device("cuda", buf.device.id))
    array = np.asarray(buf).reshape(-1)
    try:
        return torch.from_numpy(array)
    except TypeError:  # ml_dtypes' bfloat16, which torch does not read from NumPy
        return torch.from_numpy(array.view(np.uint8))


def _bytes(buf: Any) -> torch.Tensor:
    return _tensor(buf).view(torch.uint8)


def node_name() -> str:
    """What names this process's node to a torch job: torchrun's ``GROUP_RANK`` where set, else the host's name."""
    return os.environ.get("GROUP_RANK") or processor_name()


def backends(group: Any) -> Tuple[Optional[str], Optional[str]]:
    """The backends of ``group`` for host and for CUDA tensors, None where it has
    none: ``"gloo"`` serves both, ``"nccl"`` CUDA alone, and a group made with
    ``"cpu:gloo,cuda:nccl"`` names each."""
    name = str(dist.get_backend(group)).lower()
    if ":" in name:
        named = dict(part.split(":", 1) for part in name.split(","))
        return named.get("cpu"), named.get("cuda")
    return (None if name == "nccl" else name), name


#: Blocks of equal size from every rank, end to end: torch 2.13 renamed the
#: call and warns at the old name, which torch 2.11 alone has.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


#: mpi4py's nonblocking collectives, by the blocking call that stands in for each.
_NONBLOCKING = {"I" + name.lower(): name for name in ("Allreduce", "Reduce_scatter", "Allgather", "Allgatherv",
                                                      "Alltoall", "Bcast", "Reduce", "Barrier")}


class _Done:
    """The request of a call that completed when it was made."""

    def Test(self) -> bool:  # noqa: N802 (mpi4py's names)
        return True

    def Wait(self) -> None:  # noqa: N802
        return None


def _ordered(*tensors: Optional[torch.Tensor]) -> Any:
    """Torch's current stream set to CuPy's, where a tensor is on the device."""
    device = next((t.device for t in tensors if t is not None and t.is_cuda), None)
    if device is None:
        return contextlib.nullcontext()
    import cupy

    ptr = cupy.cuda.get_current_stream().ptr
    if ptr == torch.cuda.current_stream(device).cuda_stream:
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.default_stream(device) if ptr == 0 else
                             torch.cuda.ExternalStream(ptr, device=device))


class TorchComm:
    """The ranks of a process group, spoken to as an mpi4py ``Comm``.
    ``ranks`` are their ranks in torch's default group, in this comm's order."""

    #: What ``Topology.transport`` says: no MPI windows (``collectives/windows.py``), no MPI timing of the link.
    transport = "torch"

    def __init__(self, group: Any, ranks: Sequence[int], job: Optional["TorchComm"] = None):
        self.group, self.ranks = group, list(ranks)
        self.size = len(self.ranks)
        #: The whole job's comm, over which this comm's splits are agreed: set
        #: where this comm is the job, or one part of a partition split from
        #: it; None for any other group (it cannot split).
        self.job: Optional[TorchComm] = self if self.size == dist.get_world_size() else job
        self.rank = self.ranks.index(dist.get_rank())
        self.name = ""
        self._host_backend, self._device_backend = backends(group)
        #: Where host buffers cross to on a group without a host backend: the
        #: group's device, else the one current when the comm is made (a rank
        #: sets its device first), not that of whichever thread calls later.
        bound = getattr(group, "bound_device_id", None)
        self.device = bound if bound is not None else \
            torch.device("cuda", torch.cuda.current_device()) if self._host_backend is None else None

    @property
    def cuda_aware(self) -> bool:
        """Whether device buffers go to the backend as they are (NCCL), rather
        than through host buffers that spar_comm stages and counts."""
        return self._device_backend == "nccl"

    def _place(self, t: torch.Tensor, p2p: bool = False) -> torch.Tensor:
        """``t``, or a copy of it where the backend takes it (see the module's docstring)."""
        if t.is_cuda and (self._device_backend is None or (p2p and self._device_backend == "gloo")):
            return t.cpu()
        if not t.is_cuda and self._host_backend is None:
            return t.to(self.device)
        return t

    @contextlib.contextmanager
    def _placed(self, send: Optional[torch.Tensor], recv: Optional[torch.Tensor], p2p: bool = False
                ) -> Iterator[Tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]:
        """``send`` and ``recv`` as the backend takes them, on CuPy's current
        stream where either is on the device; ``recv`` is written back after."""
        with _ordered(send, recv):
            placed = [None if t is None else self._place(t, p2p) for t in (send, recv)]
            yield placed[0], placed[1]
            if recv is not None and placed[1] is not recv:
                recv.copy_(placed[1])

    def Set_name(self, name: str) -> None:  # noqa: N802
        """What the deadlines' messages call this comm ("inside a node", ...)."""
        self.name = name

    def Get_name(self) -> str:  # noqa: N802
        return self.name

    @classmethod
    def world(cls, group: Any = None) -> "TorchComm":
        """``group`` (default: torch's default group), as a comm of its own."""
        group = group if group is not None else dist.group.WORLD
        return cls(group, dist.get_process_group_ranks(group))

    # -- objects (pickled: construction and checks, never the hot path) ---------------
    def allgather(self, obj: Any) -> List[Any]:
        out: List[Any] = [None] * self.size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def bcast(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[root], group=self.group)
        return box[0]

    def allreduce(self, obj: Any, op: Any = MPI.SUM) -> Any:
        return _FOLDS[op.py2f()](self.allgather(obj))

    # -- communicators --------------------------------------------------------------
    def Split(self, color: int = 0, key: int = 0) -> Any:  # noqa: N802
        """Collective over the whole job: the ranks of each ``color`` in a
        group of their own, by ``key`` then rank (which must keep the job's
        order); ``MPI.COMM_NULL`` for ``MPI.UNDEFINED``. Every rank of the job
        makes every group (see the module's docstring), so this comm must span
        the job, or be one part of a partition of it whose parts all split now."""
        if self.job is None:
            raise ConfigError(f"spar_comm over torch.distributed splits only a group of the whole job "
                              f"({dist.get_world_size()} ranks), or one of a partition split from it; this one has "
                              f"{self.size}")
        # Each part named by its first rank in the job; a colour's group by (part, colour).
        everyone = self.job.allgather((self.ranks[0], color, key, self.rank, dist.get_rank()))
        partition = all(c != MPI.UNDEFINED for _, c, _, _, _ in everyone)
        mine = MPI.COMM_NULL
        for part, each in sorted({(p, c) for p, c, _, _, _ in everyone if c != MPI.UNDEFINED}):
            ranks = [job_rank for _, _, job_rank in sorted((k, r, j) for p, c, k, r, j in everyone
                                                           if (p, c) == (part, each))]
            if ranks != sorted(ranks):
                raise ConfigError(f"a split over torch.distributed must keep the ranks' order, got {ranks}")
            group = dist.new_group(ranks)
            if (part, each) == (self.ranks[0], color):
                mine = TorchComm(group, ranks, self.job if partition else None)
        return mine

    def Split_type(self, split_type: int, key: int = 0) -> Any:  # noqa: N802
        """The ranks of my node (``node_name``)."""
        assert split_type == MPI.COMM_TYPE_SHARED
        mine = node_name()
        names = sorted(set(self.allgather(mine)))
        return self.Split(names.index(mine), key)

    def Dup(self) -> "TorchComm":  # noqa: N802
        return self.Split(0, self.rank)

    def Free(self) -> None:  # noqa: N802
        """Groups live as long as the process group they belong to."""

    def Abort(self, code: int = 1) -> None:  # noqa: N802
        """End this process at once; torchrun then ends the others."""
        sys.stderr.flush()
        os._exit(code)

    # -- buffers -----------------------------------------------------------------------
    def Allreduce(self, send: Any, recv: Any, op: Any = MPI.SUM) -> None:  # noqa: N802
        out = _tensor(recv)
        with _ordered(out):
            if send is not MPI.IN_PLACE:
                out.copy_(_tensor(send))
        with self._placed(None, out) as (_, placed):
            if op.py2f() in _BITWISE and placed.is_cuda and self._device_backend == "nccl":  # NCCL has none
                placed.copy_(fold_bitwise(self._gathered(placed), op))
            else:
                dist.all_reduce(placed, op=_OPS[op.py2f()], group=self.group)

    def _gathered(self, mine: torch.Tensor) -> torch.Tensor:
        """Every rank's ``mine``, one row each."""
        rows = torch.empty((self.size, mine.numel()), dtype=mine.dtype, device=mine.device)
        _all_gather(rows.view(-1), mine, group=self.group)
        return rows

    def Reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int], op: Any = MPI.SUM) -> None:  # noqa: N802
        with self._placed(_tensor(send), _tensor(recv)) as (whole, mine):
            dist.reduce_scatter(mine, list(torch.split(whole, list(counts))), op=_OPS[op.py2f()], group=self.group)

    def Allgather(self, send: Any, recv: Any) -> None:  # noqa: N802
        with self._placed(_bytes(send), _bytes(recv)) as (mine, out):
            _all_gather(out, mine, group=self.group)

    def Allgatherv(self, send: Any, spec: Any) -> None:  # noqa: N802
        """``spec``: ``[recv, (counts, displacements)]`` in elements of recv's dtype."""
        recv, (counts, displacements) = spec
        width = recv.itemsize
        longest = max(counts) * width
        with self._placed(_bytes(send), _bytes(recv)) as (mine, out):
            padded = torch.zeros(longest, dtype=torch.uint8, device=out.device)
            padded[: mine.numel()] = mine
            gathered = torch.empty(longest * self.size, dtype=torch.uint8, device=out.device)
            _all_gather(gathered, padded, group=self.group)
            for r, (count, start) in enumerate(zip(counts, displacements)):
                out[start * width : (start + count) * width] = gathered[r * longest : r * longest + count * width]

    def Alltoall(self, send: Any, recv: Any) -> None:  # noqa: N802
        with self._placed(_bytes(send), _bytes(recv)) as (mine, out):
            dist.all_to_all_single(out, mine, group=self.group)

    def Bcast(self, buf: Any, root: int = 0) -> None:  # noqa: N802
        with self._placed(None, _bytes(buf)) as (_, placed):
            dist.broadcast(placed, src=self.ranks[root], group=self.group)

    def Reduce(self, send: Any, recv: Any, op: Any = MPI.SUM, root: int = 0) -> None:  # noqa: N802
        mine = None if send is MPI.IN_PLACE else _tensor(send)
        out = _tensor(recv) if self.rank == root else None
        with _ordered(mine, out):
            if out is None:
                out = mine.clone()
            elif mine is not None:
                out.copy_(mine)
        with self._placed(None, out) as (_, placed):
            dist.reduce(placed, dst=self.ranks[root], op=_OPS[op.py2f()], group=self.group)

    def Barrier(self) -> None:  # noqa: N802
        dist.barrier(group=self.group)

    def Send(self, buf: Any, dest: int, tag: int = 0) -> None:  # noqa: N802
        with self._placed(_bytes(buf), None, p2p=True) as (placed, _):
            dist.send(placed, dst=self.ranks[dest], group=self.group, tag=tag)

    def Recv(self, buf: Any, source: int, tag: int = 0) -> None:  # noqa: N802
        with self._placed(None, _bytes(buf), p2p=True) as (_, placed):
            dist.recv(placed, src=self.ranks[source], group=self.group, tag=tag)

    def Sendrecv(self, sendbuf: Any, dest: int, sendtag: int = 0, recvbuf: Any = None, source: int = 0,  # noqa: N802
                 recvtag: int = 0) -> None:
        """Both at once: two blocking sends would wait for each other. On NCCL
        as one batch: a send there may wait for its receive to have started."""
        with self._placed(_bytes(sendbuf), _bytes(recvbuf), p2p=True) as (send, recv):
            ops = [(dist.isend, send, dest, sendtag), (dist.irecv, recv, source, recvtag)]
            if send.is_cuda:
                works = dist.batch_isend_irecv([dist.P2POp(call, t, self.ranks[peer], self.group, tag)
                                                for call, t, peer, tag in ops])
            else:
                works = [call(t, self.ranks[peer], group=self.group, tag=tag) for call, t, peer, tag in ops]
            for work in works:
                work.wait()

    def __getattr__(self, name: str) -> Callable[..., _Done]:
        """The nonblocking forms (``Iallgather``, ...): done when they return."""
        blocking = _NONBLOCKING.get(name)
        if blocking is None:
            raise AttributeError(name)
        call = getattr(self, blocking)

        def started(*args: Any, **kwargs: Any) -> _Done:
            call(*args, **kwargs)
            return _Done()

        return started
