"""``hier_dense``: local Reduce_scatter -> rail Allreduce of my shard -> local Allgather.

Only 1/local_size of the vector crosses nodes from each rank, and every node
link carries the node's share once. A lossy value codec applies to the rail
Allreduce, where the bytes cross nodes (``sums.py``); inside the node the
sums stay exact.
"""
from __future__ import annotations

from typing import Any

from ..topology import shard_bounds
from .base import Allreducer
from .settings import Call
from .sums import dense_sum


class HierDenseAllreducer(Allreducer):
    name = "hier_dense"

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.node_collectives()
        self.lo, _ = topology.owned_range(self.size)
        self.rails = []  # (my part of the region for shard j, its sum over shard j's rail)
        for j, comm in topology.rails.items():
            lo, hi = shard_bounds(self.size, topology.shards_per_node, j)
            summed = dense_sum(self.channel(comm, spans_nodes=True), hi - lo, self.dtype, self.codec)
            self.rails.append((slice(lo - self.lo, hi - self.lo), summed))
        if self.codec.lossy:
            self.feedback.cover(self.lo, self.lo + self.counts[self.local.rank])

    def _reduce(self, grad: Any, call: Call) -> Any:
        region = self.allgather.region  # my shard of the result
        self.reduce_scatter(grad, region)
        acc = call.feedback.add(region)  # the region itself unless a residual is kept
        for part, summed in self.rails:
            mine = region[part]
            summed(mine if acc is region else acc[part], mine, call.feedback)
        self.averaged(region)
        out = self.output(call, zeroed=False)
        self.allgather(out)
        self.last["k"] = self.size
        return out
