"""``hitopk``: HiTopKComm (Shi et al., MLSys'21), the hierarchical sparse allreduce.

1. local Reduce_scatter: each rank of a node holds the node's sum of its shard;
2. add the residual and select k_shard = ceil(density * shard) of the shard;
3. rail Allgather of the (index, value) pairs between the shard's owners on
   every node; scatter-add (duplicates summed);
4. local Allgather of the reduced shards: each rank copies them out of the
   node's shared memory, or where the node shares none, MPI moves them as
   (index, value) pairs or dense, whichever is fewer bytes.

Only k_shard pairs per rank cross nodes, and the dense traffic stays inside
the node where bandwidth is plentiful.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from ..kernels import passes, sorted_distinct
from ..topology import shard_bounds
from .base import WHOLE_PASS_BEYOND, Allreducer
from .settings import Call


class _Site:
    """One selection site: a shard I own, its compressor and its rail's exchange."""

    def __init__(self, owner: "HiTopKAllreducer", j: int, rail):
        lo, hi = shard_bounds(owner.size, owner.topology.shards_per_node, j)
        self.lo, self.hi = lo - owner.lo, hi - owner.lo  # within my region
        self.topk = owner.top_k(hi - lo)
        self.exchange = owner.pair_exchange(rail, self.topk)


class HiTopKAllreducer(Allreducer):
    name = "hitopk"
    sparse = True

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.node_collectives()
        self.lo, self.hi = topology.owned_range(self.size)
        self.sites = [_Site(self, j, self.channel(c, spans_nodes=True)) for j, c in topology.rails.items()]
        # The node's sum of my region, where no residual takes it.
        self.node_sum = self.xp.empty(self.hi - self.lo if self.local.size > 1 and not self.error_feedback else 0,
                                      self.dtype)
        self.feedback.cover(self.lo, self.hi)
        self._written = self.xp.zeros(0, dtype=np.int64)  # the positions of the node's region the last call wrote

    @property
    def widens_in_sweep(self) -> bool:
        return self.local.size == 1 and self.feedback.on and self.memory.in_host_memory

    def _reduce(self, grad: Any, call: Call) -> Any:
        if self.local.size == 1:  # this rank is its node: its residual takes grad as topka's does
            in_place = call.output_is(grad)  # the sites' sweeps zero grad, the whole of it, for the result
            picks = [site.topk.add_and_pick(grad[site.lo : site.hi], call, slice(site.lo, site.hi), clear=in_place)
                     for site in self.sites]
            out = self.output(call, zeroed=not in_place)  # grad (perhaps ``out``) was read for the last time above
            touched = self._exchange(picks, out, call, call.feedback.residual)  # empty with feedback off
            self.averaged_at(out, touched)
            return out
        acc, picks = self._node_sum_and_picks(grad, call)
        gather = self.allgather
        reduced = gather.region  # zero but where the last call wrote
        if self._written.size > WHOLE_PASS_BEYOND * reduced.size:  # as in averaged_at
            reduced.fill(0)
            passes.book("zero-fill", 0, reduced.size)
        else:
            reduced[self._written] = 0
        touched = self._exchange(picks, reduced, call, acc)
        self.averaged_at(reduced, touched)
        self._written = touched
        out = self.output(call, zeroed=False)
        gather(out, sorted_distinct(touched) if gather.takes_positions else None)  # each position sent once
        return out

    def _exchange(self, picks: list, region: Any, call: Call, acc: Any) -> Any:
        """Every site's rail Allgather of its picks, summed into ``region`` (mine),
        a lossy codec's rounding kept in ``acc``; returns the positions touched,
        with repeats (harmless: each is read, then written back)."""
        return self.xp.concatenate([
            site.exchange(indices, values, region[site.lo : site.hi], call.feedback, acc[site.lo : site.hi]) + site.lo
            for site, (indices, values) in zip(self.sites, picks)
        ])

    def _node_sum_and_picks(self, grad: Any, call: Call) -> Tuple[Any, list]:
        """My region of the node's sum plus my residual (the array selected
        from), and each site's picks. Where the node's parts of my region come
        whole and a residual takes them, each site's candidate pass rides on
        their sum (``TopK.add_and_pick`` of the parts): one pass over my region
        where the sum, and then a selector's candidates (and ``mstopk``'s
        statistics), would each make one."""
        if self.error_feedback:  # summed straight into the residual: one pass fewer
            acc = call.feedback.residual
            if self.memory.in_host_memory and self.reduce_scatter.sums_whole and all(
                    site.hi > site.lo for site in self.sites):
                picks: list = []
                self.reduce_scatter(grad, acc, accumulate=True, summed=lambda parts: picks.extend(
                    site.topk.add_and_pick(tuple(part[site.lo : site.hi] for part in parts), call,
                                           slice(site.lo, site.hi))
                    for site in self.sites))
                return acc, picks
            self.reduce_scatter(grad, acc, accumulate=True)
        else:
            acc = self.node_sum
            self.reduce_scatter(grad, acc)
        return acc, [site.topk(acc[site.lo : site.hi], call) for site in self.sites]
