"""``hitopk``: HiTopKComm (Shi et al., MLSys'21), the hierarchical sparse allreduce.

1. local Reduce_scatter: each rank of a node holds the node's sum of its shard;
2. add the residual and select k_shard = ceil(density * shard) of the shard;
3. rail Allgather of the (index, value) pairs between the shard's owners on
   every node; scatter-add (duplicates summed);
4. local Allgather of the reduced shards, sparse or dense, whichever moves
   fewer bytes (the choice is made from counts every local rank sees).

Only k_shard pairs per rank cross nodes, and the dense traffic stays inside
the node where bandwidth is plentiful.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..kernels import sorted_distinct
from ..topology import shard_bounds
from .base import Allreducer
from .channel import displacements
from .pairs import PairLayout


class _Site:
    """One selection site: a shard I own, its compressor and its rail's exchange."""

    def __init__(self, owner: "HiTopKAllreducer", j: int, rail):
        lo, hi = shard_bounds(owner.size, owner.topology.shards_per_node, j)
        self.lo, self.hi = lo - owner.lo, hi - owner.lo  # within my region
        self.topk = owner.top_k(hi - lo)
        self.exchange = owner.pair_exchange(rail, self.topk.k, hi - lo)


class HiTopKAllreducer(Allreducer):
    name = "hitopk"
    sparse = True

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.node_reduce_scatter()
        self.offsets = displacements(self.counts)
        self.lo, self.hi = topology.owned_range(self.size)
        self.sites = [_Site(self, j, self.channel(c, spans_nodes=True)) for j, c in topology.rails.items()]
        xp = self.xp
        self.region = xp.empty(self.hi - self.lo if self.local.size > 1 and not self.error_feedback else 0, self.dtype)
        self.reduced = xp.zeros(self.hi - self.lo if self.local.size > 1 else 0, self.dtype)
        self.feedback.cover(self.lo, self.hi)
        self._count = xp.zeros(1, dtype=np.int64)
        self._counts = xp.zeros(self.local.size, dtype=np.int64)

    def _reduce(self, grad: Any) -> Any:
        acc = self._node_sum_with_residual(grad)
        picks = [site.topk(acc[site.lo : site.hi]) for site in self.sites]
        if self.local.size == 1:  # this rank is its node: sum straight into the output, as topka does
            out = self.output(zeroed=True)  # grad (perhaps ``out``) was read for the last time above
            touched = self._exchange(picks, out, acc)
            out[touched] = self.averaged(out[touched])
            return out
        reduced = self.reduced  # zero outside the positions touched below
        touched = self._exchange(picks, reduced, acc)
        reduced[touched] = self.averaged(reduced[touched])
        try:
            return self._share_in_node(reduced, sorted_distinct(touched))  # each position sent once
        finally:
            reduced[touched] = 0

    def _exchange(self, picks: list, region: Any, acc: Any) -> Any:
        """Every site's rail Allgather of its picks, summed into ``region`` (mine),
        a lossy codec's rounding kept in ``acc``; returns the positions touched,
        with repeats (harmless: each is read, then written back)."""
        return self.xp.concatenate([
            site.exchange(indices, values, region[site.lo : site.hi], acc[site.lo : site.hi]) + site.lo
            for site, (indices, values) in zip(self.sites, picks)
        ])

    def _node_sum_with_residual(self, grad: Any) -> Any:
        """My region of the node's sum plus my residual (the array to select from)."""
        if self.local.size == 1:  # a lone rank of its node holds its node's sum already
            return self.feedback.add(grad)
        if self.error_feedback:  # summed straight into the residual: one pass fewer
            self.reduce_scatter(grad, self.feedback.residual, accumulate=True)
            return self.feedback.residual
        self.reduce_scatter(grad, self.region)
        return self.region

    def _share_in_node(self, reduced: Any, positions: Any) -> Any:
        """Local Allgather of every rank's reduced region, sparse when that is smaller."""
        self._count[0] = positions.size
        self.local.allgather(self._count, self._counts)
        layouts = [PairLayout(u, self.dtype, self.xp) for u in self._counts.tolist()]
        sparse_bytes = sum(layout.nbytes for layout in layouts)
        dense = sparse_bytes >= reduced.itemsize * self.size
        out = self.output(zeroed=not dense)
        if dense:
            self.local.allgatherv(reduced, out, self.counts)
            return out
        mine = layouts[self.local.rank]
        sendbuf = mine.empty()
        values, indices = mine.views(sendbuf)
        values[:] = reduced[positions]
        indices[:] = positions
        recvbuf = self.xp.empty(sparse_bytes, dtype=np.uint8)
        self.local.allgatherv(sendbuf, recvbuf, [layout.nbytes for layout in layouts])
        start = 0
        for layout, offset in zip(layouts, self.offsets):
            values, indices = layout.views(recvbuf[start : start + layout.nbytes])
            out[offset + indices] = values
            start += layout.nbytes
        return out
