"""MPI calls that keep the books: time and ring-model bytes per call.

Every collective an allreducer makes goes through a ``Channel``: a
communicator tagged ``intra`` (inside a node) or ``inter`` (across nodes).
Bytes are what this rank sends under the ring model:

* Allgather of b bytes per rank: (p-1)*b;
* Reduce_scatter, Alltoall, or Allgather of a whole n-byte vector: (p-1)/p*n;
* Allreduce of n bytes: 2(p-1)/p*n;
* Bcast: as MPICH sends it (``bcast_bytes``): n to each child of a binomial
  tree, or a scatter and a ring allgather of n/p blocks for long messages;
  Reduce: n from every rank but the root;
* Send and Sendrecv: the message.

On a GPU the buffers are device arrays; ``memory.for_mpi`` hands them to MPI
in place (CUDA-aware) or through pinned host buffers, and
``bytes_staged`` counts the copies.

The links of an emulated cluster (``bench_comm.py --link-counters``) agree
with these counts for the rail and tree traffic; for the world Allreduce and
Allgather of ``dense`` and ``topka`` on nodes of several ranks MPICH's
butterflies cross nodes in only some steps, so the links carry less.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..memory import HOST, HostMemory


#: MPICH's Bcast: a binomial tree below this many bytes or ranks
#: (BCAST_SHORT_MSG_SIZE, BCAST_MIN_PROCS), else scatter + ring allgather.
BCAST_SHORT = 12288
BCAST_MIN_PROCS = 8


def binomial_children(rank: int, root: int, size: int) -> List[int]:
    """The relative ranks ``rank`` forwards a broadcast from ``root`` to in a
    binomial tree: the one ``2**j`` places above it for every ``2**j`` below its
    lowest set bit (``size - 1`` sends in all)."""
    relative = (rank - root) % size
    lowest = relative & -relative if relative else 1 << size.bit_length()
    return [relative + (1 << j) for j in range(size.bit_length())
            if (1 << j) < lowest and relative + (1 << j) < size]


def bcast_bytes(rank: int, root: int, size: int, nbytes: int) -> int:
    """What ``rank`` sends in MPICH's broadcast of ``nbytes``: the whole message to
    each child of the binomial tree, or, for long messages on many ranks, each
    child's subtree of ``nbytes/size`` blocks in the scatter and ``size - 1``
    blocks in the ring allgather."""
    children = binomial_children(rank, root, size)
    if nbytes < BCAST_SHORT or size < BCAST_MIN_PROCS:
        return len(children) * nbytes
    relative = (rank - root) % size
    subtrees = sum(min(child - relative, size - child) for child in children)
    return (subtrees + size - 1) * nbytes // size


def displacements(counts: Sequence[int]) -> List[int]:
    """Where each of consecutive blocks of ``counts`` starts."""
    return np.concatenate(([0], np.cumsum(counts)[:-1])).astype(int).tolist()


class Channel:
    """A communicator whose calls add their time and bytes to ``ledger``, and
    hand device buffers to MPI as ``memory`` allows (staged or in place)."""

    def __init__(self, comm: MPI.Comm, kind: str, ledger: Dict[str, float], memory: HostMemory = HOST):
        assert kind in ("intra", "inter")
        self.comm = comm
        self.size = comm.size
        self.rank = comm.rank
        self.memory = memory
        # MPI reads host memory: the buffers' own, or staging buffers
        self._on_host = memory.in_host_memory or not memory.cuda_aware
        self._t, self._b = "t_" + kind, "bytes_" + kind
        self._ledger = ledger
        ledger.setdefault("bytes_staged", 0)

    def book(self, start: float, nbytes: int) -> None:
        """Add the time since ``start`` and ``nbytes`` sent to the ledger."""
        self._ledger[self._t] += self.memory.now() - start
        self._ledger[self._b] += int(nbytes)

    def _call(self, mpi: Callable[[Any, Any], None], send: Any, recv: Any, nbytes: int) -> None:
        """``mpi(send, recv)`` on buffers MPI may take, booked as ``nbytes`` sent.
        Alone in its communicator a rank only copies ``send`` to ``recv``, where
        it is: nothing crosses, so nothing is staged."""
        start = self.memory.now()
        if self.size == 1:
            if send is not None and recv is not None and recv is not send:
                recv[...] = send
        else:
            with self.memory.for_mpi(send, recv) as (host_send, host_recv):
                mpi(host_send, host_recv)
            self._ledger["bytes_staged"] += self.memory.staged_bytes(send, recv)
        self.book(start, nbytes)

    def _collective(self, name: str, nbytes: int, *args: Any, **kwargs: Any) -> None:
        """``self.comm.<name>(*args, **kwargs)`` on buffers MPI was handed,
        ``nbytes`` a rank (equal on all): small ones on host memory wait by
        sleeping (``waiting.collective``)."""
        waiting.collective(self.comm, name, *args, nbytes=nbytes if self._on_host else math.inf, **kwargs)

    def allreduce(self, buf: Any) -> None:
        """Sum ``buf`` in place over the communicator."""
        self._call(lambda _, b: self._collective("Allreduce", b.nbytes, MPI.IN_PLACE, b, op=MPI.SUM), buf, buf,
                   2 * (self.size - 1) * buf.nbytes // self.size)

    def reduce_scatter(self, send: Any, recv: Any, counts: Sequence[int]) -> None:
        self._call(lambda s, r: self._collective("Reduce_scatter", s.nbytes, s, r, list(counts), op=MPI.SUM),
                   send, recv, (self.size - 1) * send.nbytes // self.size)

    def allgather(self, send: Any, recv: Any) -> None:
        """Equal blocks: ``recv`` holds ``size`` copies of ``send``'s length."""
        self._call(lambda s, r: self._collective("Allgather", s.nbytes, s, r), send, recv,
                   (self.size - 1) * send.nbytes)

    def alltoall(self, send: Any, recv: Any) -> None:
        """Equal blocks: block j of ``send`` goes to rank j, ``recv`` gets one from every rank."""
        self._call(lambda s, r: self._collective("Alltoall", s.nbytes, s, r), send, recv,
                   (self.size - 1) * send.nbytes // self.size)

    def allgatherv(self, send: Any, recv: Any, counts: Sequence[int]) -> None:
        """Blocks of ``counts`` elements, placed one after another in ``recv``."""
        where = (list(counts), displacements(counts))
        self._call(lambda s, r: self._collective("Allgatherv", r.nbytes // self.size, s, [r, where]), send, recv,
                   (self.size - 1) * send.nbytes)

    def bcast(self, buf: Any, root: int = 0) -> None:
        """The root only sends ``buf``, the others only receive it."""
        mine = self.rank == root
        self._call(lambda s, r: self._collective("Bcast", buf.nbytes, s if mine else r, root=root),
                   buf if mine else None, None if mine else buf, bcast_bytes(self.rank, root, self.size, buf.nbytes))

    def reduce(self, send: Any, recv: Any, root: int = 0) -> None:
        self._call(lambda s, r: self._collective("Reduce", s.nbytes, s, r, op=MPI.SUM, root=root), send, recv,
                   send.nbytes if self.rank != root else 0)

    def send(self, buf: Any, dest: int, tag: int) -> None:
        def mpi(s: Any, _: Any) -> None:
            with waiting.watched(f"Send to rank {dest}", self.comm):
                self.comm.Send(s, dest=dest, tag=tag)
        self._call(mpi, buf, None, buf.nbytes)

    def recv(self, buf: Any, source: int, tag: int) -> None:
        def mpi(_: Any, r: Any) -> None:
            with waiting.watched(f"Recv from rank {source}", self.comm):
                self.comm.Recv(r, source=source, tag=tag)
        self._call(mpi, None, buf, 0)

    def sendrecv(self, send: Any, recv: Any, partner: int, tag: int) -> None:
        """Swap equal-sized buffers with ``partner`` (both send at once)."""
        def mpi(s: Any, r: Any) -> None:
            with waiting.watched(f"Sendrecv with rank {partner}", self.comm):
                self.comm.Sendrecv(s, dest=partner, sendtag=tag, recvbuf=r, source=partner, recvtag=tag)
        self._call(mpi, send, recv, send.nbytes)
