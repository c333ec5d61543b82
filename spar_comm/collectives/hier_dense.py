"""``hier_dense``: local Reduce_scatter -> rail Allreduce of my shard -> local Allgather.

Only 1/local_size of the vector crosses nodes from each rank, and every node
link carries the node's share once.
"""
from __future__ import annotations

from typing import Any

from ..topology import shard_bounds
from .base import Allreducer


class HierDenseAllreducer(Allreducer):
    name = "hier_dense"

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.node_reduce_scatter()
        self.rails = {j: self.channel(c, spans_nodes=True) for j, c in topology.rails.items()}
        self.lo, _ = topology.owned_range(self.size)
        self.region = self.xp.empty(self.counts[self.local.rank], dtype=self.dtype)
        self.shards = topology.shards_per_node

    def _reduce(self, grad: Any) -> Any:
        region = self.region
        self.reduce_scatter(grad, region)
        for j, rail in self.rails.items():
            lo, hi = shard_bounds(self.size, self.shards, j)
            rail.allreduce(region[lo - self.lo : hi - self.lo])
        out = self.output(zeroed=False)
        self.local.allgatherv(self.averaged(region), out, self.counts)
        self.last["k"] = self.size
        return out
