"""``dense``: one ``Allreduce`` over the world, the baseline of every comparison.

With a lossy value codec (``values="float16"``, ``"bfloat16"``, ``"int8"``)
the sum travels through it instead (``sums.py``): the compressed dense
baseline, as DDP's fp16 hook sends, here with error feedback.
"""
from __future__ import annotations

from typing import Any

from .base import Allreducer
from .settings import Call
from .sums import dense_sum


class DenseAllreducer(Allreducer):
    name = "dense"

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.summed = dense_sum(self.world, self.size, self.dtype, self.codec)
        if self.codec.lossy:
            self.feedback.cover(0, self.size)

    def _reduce(self, grad: Any, call: Call) -> Any:
        out = self.output(call, zeroed=False)
        self.summed(call.feedback.add(grad), out, call.feedback)
        self.last["k"] = self.size
        return self.averaged(out)
