"""Reduce_scatter inside a node through an MPI shared-memory window.

MPI's Reduce_scatter moves every shard through message buffers: a copy in, a
copy out, then the sum. Here every rank copies the parts that other ranks own
into its own slot of one window, and each owner sums its shard straight out
of all slots, in rank order (so the bits never depend on timing). A slot
holds a bounded piece per owner, so a long vector goes in rounds and the
window stays small whatever the model size.
"""
from __future__ import annotations

import atexit
import os
import time
from typing import Dict, List, Sequence

import numpy as np
from mpi4py import MPI

from .channel import Channel, displacements

#: Bytes of window per rank at most (one piece for every owner).
SLOT_BYTES = 32 << 20
#: Set to 0 to use MPI's own Reduce_scatter instead.
ENV_SHARED_MEMORY = "SPAR_COMM_SHM"


def node_reduce_scatter(channel: Channel, counts: Sequence[int], dtype: np.dtype, shares_memory: bool):
    """The fastest Reduce_scatter the node allows, as ``reduce_scatter(send, recv)``.

    Collective over the node: its ranks agree on the choice (``SPAR_COMM_SHM``
    may differ between them) before one window is allocated."""
    wanted = int(shares_memory and os.environ.get(ENV_SHARED_MEMORY, "1") != "0")
    if channel.size > 1 and channel.comm.allreduce(wanted, op=MPI.MIN):  # the node agrees
        return SharedReduceScatter(channel, counts, dtype)
    return MessageReduceScatter(channel, counts)


class MessageReduceScatter:
    """MPI's own Reduce_scatter, behind the same call."""

    def __init__(self, channel: Channel, counts: Sequence[int]):
        self.channel, self.counts = channel, list(counts)

    def __call__(self, send: np.ndarray, recv: np.ndarray) -> None:
        self.channel.reduce_scatter(send, recv, self.counts)

    def free(self) -> None:
        pass


# Windows still open when Python exits, freed before mpi4py's MPI_Finalize (an
# atexit handler registered after mpi4py's runs first): MPICH's OFI netmod
# cannot close its fabric while a window is open. Win.Free is collective: this
# assumes all ranks exit normally together (a rank failing alone aborts the job
# instead). Strong references: a window dropped unfreed would leak in MPI and
# break MPI_Finalize, so an allreducer's window lives until free() or exit.
_OPEN: "Dict[int, SharedReduceScatter]" = {}


@atexit.register
def _free_open_windows() -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for shared in list(_OPEN.values()):
            shared.free()


class SharedReduceScatter:
    """``reduce_scatter(send, recv)`` for one vector length and ``counts``."""

    def __init__(self, channel: Channel, counts: Sequence[int], dtype: np.dtype, slot_bytes: int = SLOT_BYTES):
        comm, g, itemsize = channel.comm, channel.size, np.dtype(dtype).itemsize
        self.channel, self.comm, self.counts = channel, comm, list(counts)
        self.offsets = displacements(counts)
        self.piece = max(1, min(slot_bytes // itemsize // g, max(counts)))
        self.rounds = -(-max(self.counts) // self.piece)
        self.win = MPI.Win.Allocate_shared(g * self.piece * itemsize, itemsize, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        _OPEN[id(self)] = self
        self.slots: List[np.ndarray] = [
            np.frombuffer(self.win.Shared_query(r)[0], dtype=dtype).reshape(g, self.piece) for r in range(g)
        ]

    def __call__(self, send: np.ndarray, recv: np.ndarray) -> None:
        start = time.perf_counter()
        me, g = self.comm.rank, self.comm.size
        for t in range(self.rounds):
            lo = t * self.piece
            for owner in range(g):
                n = min(self.piece, max(0, self.counts[owner] - lo))
                if owner != me and n:
                    first = self.offsets[owner] + lo
                    self.slots[me][owner, :n] = send[first : first + n]
            self._fence()
            n = min(self.piece, max(0, self.counts[me] - lo))
            if n:
                first = self.offsets[me] + lo
                parts = [send[first : first + n] if r == me else self.slots[r][me, :n] for r in range(g)]
                out = recv[lo : lo + n]
                out[...] = parts[0]
                for part in parts[1:]:
                    out += part
            self._fence()  # every owner has read its pieces before they are overwritten
        self.channel.book(start, (g - 1) * send.nbytes // g)

    def _fence(self) -> None:
        self.win.Sync()
        self.comm.Barrier()
        self.win.Sync()

    def free(self) -> None:
        if _OPEN.pop(id(self), None) is not None:
            self.win.Unlock_all()
            self.win.Free()
