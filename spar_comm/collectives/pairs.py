"""(index, value) pairs packed into one byte buffer, so that one collective
moves both. A record for k pairs is ``[k values | pad | k indices | pad]``,
padded to 8 bytes so that every view inside it is aligned. The values are
written by a value codec (``codecs.py``): as the sum holds them, or narrower;
the indices by an index codec: int32 positions, or fewer bytes.

Buffers are arrays of the channel's memory (host or GPU); the views are taken
on the whole contiguous buffer, which NumPy and CuPy both allow.
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import numpy as np

from ..kernels import scatter_add
from .codecs import Exact, Int32Indices

INDEX = np.dtype(np.int32)


def up8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class PairLayout:
    """The byte layout of one record of ``k`` pairs of ``dtype`` values, written
    by ``codec`` and ``indices`` (default: values as they are and int32
    positions, which ``views`` and ``all_views`` need)."""

    def __init__(self, k: int, dtype: np.dtype, xp: Any = np, codec: Any = None, indices: Any = None):
        self.k = k
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self.codec = codec if codec is not None else Exact(self.dtype, xp)
        self.indices = indices if indices is not None else Int32Indices(k, 0, xp)
        self.index_offset = up8(self.codec.nbytes(k))
        self.nbytes = up8(self.index_offset + self.indices.nbytes())
        self.plain_indices = type(self.indices) is Int32Indices

    def empty(self, records: int = 1) -> Any:
        """A zeroed buffer for ``records`` records (zeroed: padding is sent too)."""
        return self.xp.zeros(records * self.nbytes, dtype=np.uint8)

    def views(self, buf: Any, record: int = 0) -> Tuple[Any, Any]:
        """(values, indices) of one record of ``buf``, as writable views."""
        values, indices = self.all_views(buf[record * self.nbytes : (record + 1) * self.nbytes], 1)
        return values[0], indices[0]

    def write(self, buf: Any, indices: Any, values: Any) -> None:
        """Encode one record into ``buf``."""
        self.codec.encode(values, buf[: self.index_offset])
        self.indices.encode(indices, buf[self.index_offset : self.nbytes])

    def read_all(self, buf: Any, records: int) -> Tuple[Any, Any]:
        """(values, indices) of every record, each (records, k), values decoded."""
        if not self.codec.lossy and self.plain_indices:
            return self.all_views(buf, records)
        rows = buf[: records * self.nbytes].reshape(records, self.nbytes)
        return self.codec.decode(rows, self.k), self.indices.decode(rows[:, self.index_offset :])

    def all_views(self, buf: Any, records: int) -> Tuple[Any, Any]:
        """(values, indices) of every record, each of shape (records, k), in record order."""
        whole = buf[: records * self.nbytes]
        values = whole.view(self.dtype).reshape(records, self.nbytes // self.dtype.itemsize)
        indices = whole.view(INDEX).reshape(records, self.nbytes // INDEX.itemsize)
        first = self.index_offset // INDEX.itemsize
        return values[:, : self.k], indices[:, first : first + self.k]


class PairExchange:
    """Allgather of k (index, value) pairs from every rank of a channel, summed
    into a dense vector in rank order (so every rank gets the same bits).

    k is the call's (every rank sends as many pairs), at most ``k_most``, by
    whose record the buffers are sized: a record of fewer pairs is never
    longer, whatever the codecs. ``layout_of(k)`` makes the record of k
    pairs (a value codec and an index codec of ``codecs.py``)."""

    def __init__(self, channel, k_most: int, layout_of: Callable[[int], PairLayout]):
        self.channel, self.layout_of = channel, layout_of
        self.layout = layout_of(k_most)
        self.sendbuf = self.layout.empty()
        self.recvbuf = self.layout.empty(channel.size)

    def __call__(self, indices: Any, values: Any, out: Any, feedback: Any, acc: Any) -> Any:
        """Add every rank's pairs into ``out``; return the indices touched. What a
        lossy codec rounded away from this rank's ``values`` goes back to the
        residual ``acc`` at ``indices`` (``feedback.keep_rounding``)."""
        if len(indices) != self.layout.k:
            self.layout = self.layout_of(len(indices))
        layout, records = self.layout, self.channel.size
        sendbuf, recvbuf = self.sendbuf[: layout.nbytes], self.recvbuf[: records * layout.nbytes]
        layout.write(sendbuf, indices, values)
        self.channel.allgather(sendbuf, recvbuf)
        all_values, all_indices = layout.read_all(recvbuf, records)
        scatter_add(out, all_indices, all_values)
        if layout.codec.lossy:  # this rank's values, decoded with the rest
            feedback.keep_rounding(acc, indices, values, all_values[self.channel.rank])
        return all_indices.ravel()
