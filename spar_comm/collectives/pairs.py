"""(index, value) pairs packed into one byte buffer, so that one collective
moves both. A record for k pairs is ``[k values | pad | k int32 indices | pad]``,
padded to 8 bytes so that every view inside it is aligned.

Buffers are arrays of the channel's memory (host or GPU); the views are taken
on the whole contiguous buffer, which NumPy and CuPy both allow.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ..kernels import scatter_add

INDEX = np.dtype(np.int32)


def _up8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class PairLayout:
    """The byte layout of one record of ``k`` pairs of ``dtype`` values."""

    def __init__(self, k: int, dtype: np.dtype, xp: Any = np):
        self.k = k
        self.dtype = np.dtype(dtype)
        self.xp = xp
        self.index_offset = _up8(k * self.dtype.itemsize)
        self.nbytes = _up8(self.index_offset + k * INDEX.itemsize)

    def empty(self, records: int = 1) -> Any:
        """A zeroed buffer for ``records`` records (zeroed: padding is sent too)."""
        return self.xp.zeros(records * self.nbytes, dtype=np.uint8)

    def views(self, buf: Any, record: int = 0) -> Tuple[Any, Any]:
        """(values, indices) of one record of ``buf``, as writable views."""
        values, indices = self.all_views(buf[record * self.nbytes : (record + 1) * self.nbytes], 1)
        return values[0], indices[0]

    def all_views(self, buf: Any, records: int) -> Tuple[Any, Any]:
        """(values, indices) of every record, each of shape (records, k), in record order."""
        whole = buf[: records * self.nbytes]
        values = whole.view(self.dtype).reshape(records, self.nbytes // self.dtype.itemsize)
        indices = whole.view(INDEX).reshape(records, self.nbytes // INDEX.itemsize)
        first = self.index_offset // INDEX.itemsize
        return values[:, : self.k], indices[:, first : first + self.k]


class PairExchange:
    """Allgather of k (index, value) pairs from every rank of a channel, summed
    into a dense vector in rank order (so every rank gets the same bits)."""

    def __init__(self, channel, k: int, dtype: np.dtype):
        self.channel = channel
        self.layout = PairLayout(k, dtype, channel.memory.xp)
        self.sendbuf = self.layout.empty()
        self.recvbuf = self.layout.empty(channel.size)

    def __call__(self, indices: Any, values: Any, out: Any) -> Any:
        """Add every rank's pairs into ``out``; returns the indices touched."""
        send_values, send_indices = self.layout.views(self.sendbuf)
        send_values[:] = values
        send_indices[:] = indices
        self.channel.allgather(self.sendbuf, self.recvbuf)
        all_values, all_indices = self.layout.all_views(self.recvbuf, self.channel.size)
        scatter_add(out, all_indices, all_values)
        return all_indices.ravel()
