"""Dense sums over a channel: MPI's own Allreduce, or one through a value codec.

Both are called as ``summed(acc, out, feedback)``, so that ``dense`` and
``hier_dense`` need not know which they have (``dense_sum`` picks).

MPI cannot sum float16, bfloat16 or int8 blocks, so a sum through a lossy
codec is taken by hand, as ZeRO++'s qgZ does with its quantized gradients:

1. every rank encodes its vector in ``p`` chunks and sends chunk j to rank j
   (one Alltoall);
2. each rank decodes the ``p`` versions of its chunk and sums them in rank
   order, in the sum dtype;
3. it encodes that sum once, and the world allgathers the encoded sums, so
   every rank decodes the same bits.

Each rank sends 2(p-1)/p of the encoded vector, as a ring allreduce of the
narrow values would. With error feedback, a rank keeps what its own
encoding rounded away (exactly), and a chunk's owner adds what the encoding
of the chunk's sum rounded away: summed over ranks, the result and the
residuals are what came in, to the rounding of that one addition.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..topology import shard_bounds
from .channel import Channel
from .codecs import Exact
from .feedback import ErrorFeedback
from .pairs import up8


def dense_sum(channel: Channel, length: int, dtype: np.dtype, codec: Exact) -> Any:
    """The sum over ``channel`` of vectors of ``length``: MPI's when ``codec``
    sends the values as they are, else through it."""
    return CodedAllreduce(channel, length, dtype, codec) if codec.lossy else ExactAllreduce(channel)


class ExactAllreduce:
    """MPI's Allreduce, in place in ``out``."""

    def __init__(self, channel: Channel):
        self.channel = channel

    def __call__(self, acc: Any, out: Any, feedback: ErrorFeedback) -> None:
        """Write the sum of every rank's ``acc`` into ``out`` (which may be ``acc``)."""
        if out is not acc:
            out[...] = acc
        self.channel.allreduce(out)


class CodedAllreduce:
    """The sum over ``channel`` of vectors of ``length``, sent through ``codec``."""

    def __init__(self, channel: Channel, length: int, dtype: np.dtype, codec: Exact):
        self.channel, self.codec = channel, codec
        xp, p = channel.memory.xp, channel.size
        self.bounds = [shard_bounds(length, p, j) for j in range(p)]
        self.width = max(hi - lo for lo, hi in self.bounds)  # every chunk is encoded at this width, zero-padded
        self.block = up8(codec.nbytes(self.width))
        self.chunks = xp.zeros((p, self.width), dtype=dtype)
        self.sendbuf = xp.zeros(p * self.block, dtype=np.uint8)
        self.recvbuf = xp.zeros(p * self.block, dtype=np.uint8)
        self.mine = xp.zeros(self.block, dtype=np.uint8)  # my chunk's sum, encoded
        self.sums = xp.zeros(p * self.block, dtype=np.uint8)

    def __call__(self, acc: Any, out: Any, feedback: ErrorFeedback) -> None:
        """Write the sum of every rank's ``acc`` into ``out`` (which may be
        ``acc``: it is written last). With ``feedback`` on, ``acc`` is the
        residual and keeps what the codec rounded away."""
        rank, codec = self.channel.rank, self.codec
        for j, (lo, hi) in enumerate(self.bounds):
            self.chunks[j, : hi - lo] = acc[lo:hi]
            codec.encode(self.chunks[j], self.rows(self.sendbuf)[j])
        if feedback.on:
            sent = codec.decode(self.rows(self.sendbuf), self.width)
            for j, (lo, hi) in enumerate(self.bounds):
                feedback.keep_rounding(acc, slice(lo, hi), self.chunks[j, : hi - lo], sent[j, : hi - lo])
        self.channel.alltoall(self.sendbuf, self.recvbuf)
        versions = codec.decode(self.rows(self.recvbuf), self.width)  # (p, width): every rank's take of my chunk
        total = versions[0].copy()
        for version in versions[1:]:  # in rank order: the same bits on every rank
            total += version
        codec.encode(total, self.mine)
        self.channel.allgather(self.mine, self.sums)
        sums = codec.decode(self.rows(self.sums), self.width)
        lo, hi = self.bounds[rank]
        if feedback.on:  # the rounding of my chunk's sum is mine to keep
            acc[lo:hi] += total[: hi - lo] - sums[rank, : hi - lo]
        for j, (lo, hi) in enumerate(self.bounds):
            out[lo:hi] = sums[j, : hi - lo]

    def rows(self, buf: Any) -> Any:
        """``buf`` as one row of ``block`` bytes per rank."""
        return buf.reshape(self.channel.size, self.block)
