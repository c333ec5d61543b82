"""``topka``: TopK-A, the DGC-style sparse allreduce.

Each rank adds its residual, selects k = ceil(density*n) entries, and the
world allgathers the (index, value) pairs; every rank then sums them. Bytes
per rank grow with the world size: (p-1) records of k values and k int32
indices (each part padded to 8 bytes, see pairs.py).
"""
from __future__ import annotations

from typing import Any

from .base import Allreducer
from .settings import Call


class TopKAllgatherAllreducer(Allreducer):
    name = "topka"
    sparse = True

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.topk = self.top_k(self.size)
        self.exchange = self.pair_exchange(self.world, self.topk)
        self.feedback.cover(0, self.size)

    @property
    def widens_in_sweep(self) -> bool:
        return self.feedback.on and self.memory.in_host_memory

    def _reduce(self, grad: Any, call: Call) -> Any:
        in_place = call.output_is(grad)  # then the sweep that reads grad zeroes it for the result
        indices, values = self.topk.add_and_pick(grad, call, clear=in_place)
        out = self.output(call, zeroed=not in_place)
        touched = self.exchange(indices, values, out, call.feedback, call.feedback.residual)
        self.averaged_at(out, touched)
        return out
