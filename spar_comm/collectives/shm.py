"""The node's Reduce_scatter and Allgather through shared-memory windows
(``windows.py``: MPI's, or a file in /dev/shm under a torch.distributed group).

MPI's collectives move every block through message buffers: a copy in, a
copy out (and for Reduce_scatter the sum). Here the node's ranks read each
other's memory instead.

Reduce_scatter: every rank copies the parts that other ranks own into its
own slot of one window, and each owner sums its shard straight out of all
slots, in rank order (so the bits never depend on timing). A slot holds a
bounded piece per owner, so a long vector goes in rounds and the window
stays small whatever the model size. Each slot is double: rounds (and calls)
alternate between its two halves, so one fence per round is enough. A rank
writes a half again only after the next round's fence, which every owner
passes only once it has read that half.

With a shared buffer (``shared_buffer=True`` on the allreducer) each rank's
segment is instead a whole vector that the caller may assemble its gradient
in: owners then read it where it lies, and nothing is copied in at all.

Allgather: each rank builds its part of the result in its segment of a
second window (``region``); one fence publishes every part, and each rank
copies them all into its result: one copy, where MPI's Allgatherv makes two.
That fence also ends the Reduce_scatter's reads of the shared buffers, so
the pair needs two fences a call: one before the sums, one before the copies.
"""
from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np
from mpi4py import MPI

from ..kernels import passes
from .channel import Channel, displacements
from .pairs import PairLayout
from .windows import WindowError, open_window

#: Bytes of window per rank at most (two halves, each a piece for every other owner).
SLOT_BYTES = 64 << 20
#: Elements summed at a time by ``sum_parts`` (256 KiB of float32).
SUM_CHUNK = 1 << 16
#: Set to 0 to use MPI's own Reduce_scatter and Allgatherv instead.
ENV_SHARED_MEMORY = "SPAR_COMM_SHM"
#: A Reduce_scatter's ``summed``: given the parts of this rank's shard, it sums them itself.
Summed = Optional[Callable[[Tuple[np.ndarray, ...]], None]]


def node_collectives(channel: Channel, counts: Sequence[int], dtype: np.dtype, shares_memory: bool,
                     shared_buffer: bool = False) -> Tuple[Any, Any]:
    """The fastest Reduce_scatter and Allgather the node allows, as a pair
    ``(reduce_scatter, allgather)``:

    * ``reduce_scatter(send, recv, accumulate=False, summed=None)`` leaves
      this rank's shard of the node's sum in ``recv``, or with ``accumulate``
      adds it to ``recv`` (the residual) in the same pass; its ``.buffer`` is,
      with ``shared_buffer``, a whole vector in shared memory where a gradient
      assembled is read in place (no copy in), and None otherwise. Where
      ``.sums_whole``, the shard's parts come in one piece, and a ``summed``
      given is called with them (every rank's, in rank order) to sum them
      itself, in a pass of its own making (a selection's candidate pass
      riding on it), its time not booked here;
    * ``allgather(out, positions=None)`` fills ``out`` with every rank's
      ``allgather.region`` (this rank's part of the result, ``counts[rank]``
      long), given the positions of its nonzeros where the caller knows them.

    Every call of the pair's ``reduce_scatter`` must be followed by one of its
    ``allgather`` before the caller writes its buffer or ``recv`` again.
    Collective over the node: its ranks agree on the choice (``SPAR_COMM_SHM``
    may differ between them) before any window is allocated, and on the
    messages, with a warning, where a file window cannot be made."""
    wanted = int(shares_memory and os.environ.get(ENV_SHARED_MEMORY, "1") != "0")
    if channel.size > 1 and channel.comm.allreduce(wanted, op=MPI.MIN):  # the node agrees
        scatter = BufferedReduceScatter if shared_buffer else SharedReduceScatter
        made: List[Any] = []
        try:
            made.append(scatter(channel, counts, dtype))
            made.append(SharedAllgather(channel, counts, dtype))
            return made[0], made[1]
        except WindowError as error:  # on every rank of the node alike
            for collective in made:
                collective.free()
            warnings.warn(f"{error}; the node's collectives go by messages instead (a larger /dev/shm, or "
                          f"{ENV_SHARED_MEMORY}=0 to choose them)", RuntimeWarning, stacklevel=3)
    return MessageReduceScatter(channel, counts), MessageAllgather(channel, counts, dtype)


def sum_parts(parts: Sequence[np.ndarray], out: np.ndarray, accumulate: bool = False) -> None:
    """``out = parts[0] + parts[1] + ...`` in that order, or ``out +=`` that sum.

    Chunk by chunk, so the partial sum stays in cache: one pass over memory
    instead of one per part (the bits are those of summing whole arrays)."""
    passes.book("node sum", sum(part.size for part in parts) + (out.size if accumulate else 0), out.size)
    chunk = np.empty(min(SUM_CHUNK, out.size), out.dtype)
    for lo in range(0, out.size, SUM_CHUNK):
        hi = min(lo + SUM_CHUNK, out.size)
        partial = chunk[: hi - lo]
        if len(parts) == 1:
            partial[...] = parts[0][lo:hi]
        else:
            np.add(parts[0][lo:hi], parts[1][lo:hi], out=partial)
        for part in parts[2:]:
            partial += part[lo:hi]
        if accumulate:
            out[lo:hi] += partial
        else:
            out[lo:hi] = partial


class MessageReduceScatter:
    """MPI's own Reduce_scatter, behind the same call."""

    buffer = None
    sums_whole = False  # MPI sums

    def __init__(self, channel: Channel, counts: Sequence[int]):
        self.channel, self.counts = channel, list(counts)
        self._sum = None  # made like the first recv given (NumPy or CuPy)

    def __call__(self, send: np.ndarray, recv: np.ndarray, accumulate: bool = False, summed: Summed = None) -> None:
        if summed is not None:
            raise ValueError("summed= needs the shard's parts, and MPI's Reduce_scatter sums them itself")
        if not accumulate:
            self.channel.reduce_scatter(send, recv, self.counts)
            return
        if self._sum is None or self._sum.shape != recv.shape or self._sum.dtype != recv.dtype:
            self._sum = self.channel.memory.xp.empty_like(recv)
        self.channel.reduce_scatter(send, self._sum, self.counts)
        recv += self._sum

    def free(self) -> None:
        pass


class SharedReduceScatter:
    """``reduce_scatter(send, recv, accumulate=False, summed=None)`` for one
    vector length and ``counts``, through bounded slots. Rank r's slot has a
    row for every other owner o, at ``_row(o, r)``: nobody copies the shard it
    owns. A shard that fits one round (``sums_whole``) may go to ``summed``:
    its parts stay in their slot half until the next call's fence."""

    buffer = None

    def __init__(self, channel: Channel, counts: Sequence[int], dtype: np.dtype, slot_bytes: int = SLOT_BYTES):
        g, itemsize = channel.size, np.dtype(dtype).itemsize
        self.channel, self.comm, self.counts = channel, channel.comm, list(counts)
        self.offsets = displacements(counts)
        rows = max(1, g - 1)
        self.piece = max(1, min(slot_bytes // itemsize // (2 * rows), max(counts)))
        self.rounds = -(-max(self.counts) // self.piece)
        self.window = open_window(self.comm, 2 * rows * self.piece, dtype)
        self.slots = [segment.reshape(2, rows, self.piece) for segment in self.window.segments]
        self.half = 0  # the half of every slot the next round uses
        self.sums_whole = self.rounds == 1

    def __call__(self, send: np.ndarray, recv: np.ndarray, accumulate: bool = False, summed: Summed = None) -> None:
        if summed is not None and not self.sums_whole:
            raise ValueError(f"summed= needs the shard in one round; this one takes {self.rounds}")
        start = time.perf_counter()
        me, g = self.comm.rank, self.comm.size
        parts: List[np.ndarray] = []
        for t in range(self.rounds):
            lo, h = t * self.piece, self.half
            for owner in range(g):
                n = min(self.piece, max(0, self.counts[owner] - lo))
                if owner != me and n:
                    first = self.offsets[owner] + lo
                    self.slots[me][h, _row(owner, me), :n] = send[first : first + n]
                    passes.book("node copy in", n, n)
            self.window.fence()
            n = min(self.piece, max(0, self.counts[me] - lo))
            if n:
                first = self.offsets[me] + lo
                parts = [send[first : first + n] if r == me else self.slots[r][h, _row(me, r), :n] for r in range(g)]
                if summed is None:
                    sum_parts(parts, recv[lo : lo + n], accumulate)
            self.half = 1 - h
        self.channel.book(start, (g - 1) * send.nbytes // g)
        if summed is not None:  # one round (sums_whole): the parts are still in the slots
            summed(tuple(parts))

    def free(self) -> None:
        self.window.free()


def _row(owner: int, writer: int) -> int:
    """The row of ``writer``'s slot that holds ``owner``'s piece."""
    return owner - (owner > writer)


class BufferedReduceScatter:
    """``reduce_scatter(send, recv, accumulate=False, summed=None)`` where each
    rank's window segment is a whole vector, ``.buffer``. A gradient assembled
    in ``.buffer`` is read where it lies; any other ``send`` is first copied
    there (the parts other ranks own). Each owner sums its shard out of every
    rank's buffer.

    Other ranks may still be reading this rank's buffer when the call
    returns: only the fence of the ``SharedAllgather`` that follows (see
    ``node_collectives``) ends their reads, and a rank writes its buffer
    again only after it."""

    sums_whole = True

    def __init__(self, channel: Channel, counts: Sequence[int], dtype: np.dtype):
        self.channel, self.comm, self.counts = channel, channel.comm, list(counts)
        self.shards = [slice(first, first + n) for first, n in zip(displacements(counts), self.counts)]
        self.window = open_window(self.comm, sum(self.counts), dtype)
        self.buffer = self.window.segments[self.comm.rank]
        self.buffer[...] = 0  # as a plain buffer starts; MPI does not promise it

    def __call__(self, send: np.ndarray, recv: np.ndarray, accumulate: bool = False, summed: Summed = None) -> None:
        start = time.perf_counter()
        me, g, shards = self.comm.rank, self.comm.size, self.shards
        if send.ctypes.data != self.buffer.ctypes.data:  # send is whole and contiguous (checked by the caller)
            for owner in range(g):
                if owner != me:
                    self.buffer[shards[owner]] = send[shards[owner]]
            passes.book("node copy in", send.size - self.counts[me], send.size - self.counts[me])
        self.window.fence()
        parts = [send[shards[me]] if r == me else self.window.segments[r][shards[me]] for r in range(g)]
        if summed is None:
            sum_parts(parts, recv, accumulate)
        self.channel.book(start, (g - 1) * send.nbytes // g)
        if summed is not None:
            summed(tuple(parts))

    def free(self) -> None:
        self.window.free()


class SharedAllgather:
    """``allgather(out)``: every rank's ``region`` (a segment of a shared window)
    copied into ``out``, after one fence.

    A rank writes its region again only in its next call of the pair, after
    that call's Reduce_scatter has fenced; no rank passes that fence before
    it has finished copying this call's regions, so no second fence is needed."""

    #: The positions of the region's nonzeros would not help: nothing is packed.
    takes_positions = False

    def __init__(self, channel: Channel, counts: Sequence[int], dtype: np.dtype):
        self.channel, self.counts = channel, list(counts)
        self.offsets = displacements(counts)
        self.window = open_window(channel.comm, max(self.counts), dtype)
        self.region = self.window.segments[channel.rank][: self.counts[channel.rank]]
        self.region[...] = 0  # as a plain region starts

    def __call__(self, out: np.ndarray, positions: Optional[np.ndarray] = None) -> None:
        start = time.perf_counter()
        self.window.fence()
        for segment, first, n in zip(self.window.segments, self.offsets, self.counts):
            out[first : first + n] = segment[:n]
        passes.book("node copy out", out.size, out.size)
        self.channel.book(start, (self.channel.size - 1) * self.region.nbytes)

    def free(self) -> None:
        self.window.free()


class MessageAllgather:
    """MPI's Allgatherv of every rank's ``region``, behind the same call; given
    the positions of the region's nonzeros, (position, value) pairs instead
    wherever those move fewer bytes (decided from counts that every rank sees)."""

    takes_positions = True

    def __init__(self, channel: Channel, counts: Sequence[int], dtype: np.dtype):
        xp = channel.memory.xp
        self.channel, self.counts, self.dtype = channel, list(counts), np.dtype(dtype)
        self.offsets = displacements(counts)
        self.region = xp.zeros(self.counts[channel.rank], self.dtype)
        self._count = xp.zeros(1, dtype=np.int64)
        self._counts = xp.zeros(channel.size, dtype=np.int64)

    def __call__(self, out: Any, positions: Any = None) -> None:
        if positions is None or not self._sparse(out, positions):
            self.channel.allgatherv(self.region, out, self.counts)

    def _sparse(self, out: Any, positions: Any) -> bool:
        """Send the pairs at ``positions`` if that moves fewer bytes than the
        regions; whether it did."""
        xp = self.channel.memory.xp
        self._count[0] = positions.size
        self.channel.allgather(self._count, self._counts)
        layouts = [PairLayout(u, self.dtype, xp) for u in self._counts.tolist()]
        sparse_bytes = sum(layout.nbytes for layout in layouts)
        if sparse_bytes >= self.dtype.itemsize * sum(self.counts):
            return False
        mine = layouts[self.channel.rank]
        sendbuf = mine.empty()
        values, indices = mine.views(sendbuf)
        values[:] = self.region[positions]
        indices[:] = positions
        recvbuf = xp.empty(sparse_bytes, dtype=np.uint8)
        self.channel.allgatherv(sendbuf, recvbuf, [layout.nbytes for layout in layouts])
        out.fill(0)
        start = 0
        for layout, offset in zip(layouts, self.offsets):
            values, indices = layout.views(recvbuf[start : start + layout.nbytes])
            out[offset + indices] = values
            start += layout.nbytes
        return True

    def free(self) -> None:
        pass
