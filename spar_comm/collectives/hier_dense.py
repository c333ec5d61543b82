"""``hier_dense``: local Reduce_scatter -> rail Allreduce of my shard -> local Allgather.

Only 1/local_size of the vector crosses nodes from each rank, and every node
link carries the node's share once. A lossy value codec applies to the rail
Allreduce, where the bytes cross nodes (``coded.py``); inside the node the
sums stay exact.
"""
from __future__ import annotations

from typing import Any

from ..topology import shard_bounds
from .base import Allreducer
from .coded import CodedAllreduce


class HierDenseAllreducer(Allreducer):
    name = "hier_dense"

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.node_reduce_scatter()
        self.lo, _ = topology.owned_range(self.size)
        self.region = self.xp.empty(self.counts[self.local.rank], dtype=self.dtype)
        self.rails = []  # (my slice of the region for rail j, its channel, its coded sum or None)
        for j, comm in topology.rails.items():
            lo, hi = shard_bounds(self.size, topology.shards_per_node, j)
            rail = self.channel(comm, spans_nodes=True)
            coded = CodedAllreduce(rail, hi - lo, self.dtype, self.codec) if self.codec.lossy else None
            self.rails.append((slice(lo - self.lo, hi - self.lo), rail, coded))
        if self.codec.lossy:
            self.feedback.cover(self.lo, self.lo + len(self.region))

    def _reduce(self, grad: Any) -> Any:
        region = self.region
        self.reduce_scatter(grad, region)
        acc = self.feedback.add(region) if self.codec.lossy else region
        for part, rail, coded in self.rails:
            if coded is None:
                rail.allreduce(region[part])
            else:
                coded(acc[part], region[part], self.feedback)
        out = self.output(zeroed=False)
        self.local.allgatherv(self.averaged(region), out, self.counts)
        self.last["k"] = self.size
        return out
