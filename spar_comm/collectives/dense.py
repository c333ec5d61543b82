"""``dense``: one ``Allreduce`` over the world, the baseline of every comparison.

With a lossy value codec (``values="float16"``, ``"bfloat16"``, ``"int8"``)
the sum travels through it instead (``coded.py``): the compressed dense
baseline, as DDP's fp16 hook sends, here with error feedback.
"""
from __future__ import annotations

from typing import Any

from .base import Allreducer
from .coded import CodedAllreduce


class DenseAllreducer(Allreducer):
    name = "dense"

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.coded = None
        if self.codec.lossy:
            self.coded = CodedAllreduce(self.world, self.size, self.dtype, self.codec)
            self.feedback.cover(0, self.size)

    def _reduce(self, grad: Any) -> Any:
        out = self.output(zeroed=False)
        if self.coded is not None:
            self.coded(self.feedback.add(grad), out, self.feedback)
        else:
            if out is not grad:
                out[...] = grad
            self.world.allreduce(out)
        self.last["k"] = self.size
        return self.averaged(out)
