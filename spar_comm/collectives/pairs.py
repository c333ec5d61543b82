"""(index, value) pairs packed into one byte buffer, so that one collective
moves both. A record for k pairs is ``[k values | pad | k int32 indices | pad]``,
padded to 8 bytes so that every view inside it is aligned.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np

from ..kernels import scatter_add

INDEX = np.dtype(np.int32)


def _up8(nbytes: int) -> int:
    return -(-nbytes // 8) * 8


class PairLayout:
    """The byte layout of one record of ``k`` pairs of ``dtype`` values."""

    def __init__(self, k: int, dtype: np.dtype):
        self.k = k
        self.dtype = np.dtype(dtype)
        self.index_offset = _up8(k * self.dtype.itemsize)
        self.nbytes = _up8(self.index_offset + k * INDEX.itemsize)

    def empty(self, records: int = 1) -> np.ndarray:
        """A zeroed buffer for ``records`` records (zeroed: padding is sent too)."""
        return np.zeros(records * self.nbytes, dtype=np.uint8)

    def views(self, buf: np.ndarray, record: int = 0) -> Tuple[np.ndarray, np.ndarray]:
        """(values, indices) of one record of ``buf``, as writable views."""
        base = record * self.nbytes
        values = buf[base : base + self.k * self.dtype.itemsize].view(self.dtype)
        indices = buf[base + self.index_offset : base + self.index_offset + self.k * INDEX.itemsize]
        return values, indices.view(INDEX)

    def all_views(self, buf: np.ndarray, records: int) -> Tuple[np.ndarray, np.ndarray]:
        """(values, indices) of every record, each of shape (records, k), in record order."""
        table = buf[: records * self.nbytes].reshape(records, self.nbytes)
        values = table[:, : self.k * self.dtype.itemsize].view(self.dtype)
        indices = table[:, self.index_offset : self.index_offset + self.k * INDEX.itemsize]
        return values, indices.view(INDEX)


class PairExchange:
    """Allgather of k (index, value) pairs from every rank of a channel, summed
    into a dense vector in rank order (so every rank gets the same bits)."""

    def __init__(self, channel, k: int, dtype: np.dtype):
        self.channel = channel
        self.layout = PairLayout(k, dtype)
        self.sendbuf = self.layout.empty()
        self.recvbuf = self.layout.empty(channel.size)

    def __call__(self, indices: np.ndarray, values: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Add every rank's pairs into ``out``; returns the indices touched."""
        send_values, send_indices = self.layout.views(self.sendbuf)
        send_values[:] = values
        send_indices[:] = indices
        self.channel.allgather(self.sendbuf, self.recvbuf)
        all_values, all_indices = self.layout.all_views(self.recvbuf, self.channel.size)
        touched = all_indices.ravel()
        scatter_add(out, touched, all_values.ravel())
        return touched
