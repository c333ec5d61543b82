"""``adasum``: Adasum (Maleki et al., MLSys'21) between nodes, a sum inside them, as Horovod runs it.

1. local Reduce_scatter: each rank holds its shards of the node's sum, divided
   by the node's size when averaging (Horovod averages inside the node too, so
   that Adasum combines vectors of one gradient's scale);
2. between nodes, a binary tree of adaptive sums by recursive doubling: at
   level l node m swaps its shards with node m xor 2**l over the shard rails,
   and both replace them with

       adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b

   where a is the lower node's vector (a zero vector yields the other). The
   products are over the whole vector: each rank takes them on its shards in
   float64, the node's ranks allgather these partials and add them in shard
   order, and the combination is made in float64, so both nodes of a pair
   hold the same bits;
3. local Allgather of the shards.

A node count that is not a power of two, with P the largest power of two
below it: node P+i first sends its shards to node i, which takes
adasum(own, node P+i's); nodes 0..P-1 run the tree; node i sends the result
back to node P+i.

Adasum is not a sum, nor a mean: for the same gradient g on every rank it
returns g (``average=True``), or g times the node's size (``average=False``,
which sums inside the node); for orthogonal node vectors it returns their
sum. Nothing is selected, so there is no residual.

Bytes per rank, with a shard of n/local_size values: inside the node those of
``hier_dense`` and 24 bytes per shard per level for the partials; between
nodes the shard at each of the log2(P) levels, and once more for a fold.
Horovod's vector halving sends about twice the shard in all instead: the same
up to 2 nodes, less from 4 on; the whole shard per level keeps every
product in one place and the rule above short.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..topology import shard_bounds, shard_owner
from .base import Allreducer
from .settings import Call

_FOLD, _LEVEL, _UNFOLD = 1, 2, 3  # message tags


class AdasumAllreducer(Allreducer):
    name = "adasum"
    sums = False

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.node_collectives()
        self.lo, hi = topology.owned_range(self.size)
        self.theirs = self.xp.empty(hi - self.lo, self.dtype)
        shards = topology.shards_per_node
        # My shards within my region, each with its rail (rail rank = node).
        self.spans = [tuple(b - self.lo for b in shard_bounds(self.size, shards, j)) for j in topology.rails]
        self.rails = [self.channel(c, spans_nodes=True) for c in topology.rails.values()]
        owners = [shard_owner(j, self.local.size, shards) for j in range(shards)]
        self.partial_counts = [3 * owners.count(r) for r in range(self.local.size)]
        # Float64 work: both vectors, and one product at a time.
        self.wide_a, self.wide_b, self.product = (self.xp.empty(hi - self.lo, np.float64) for _ in range(3))
        self.partials = self.xp.zeros(3 * len(self.spans), np.float64)
        self.all_partials = self.xp.zeros(3 * shards, np.float64)

    def _reduce(self, grad: Any, call: Call) -> Any:
        region = self.allgather.region  # my shards of the result
        self.reduce_scatter(grad, region)
        if self.settings.average and self.local.size > 1:
            region /= self.local.size
        node, nodes = self.topology.node, self.topology.num_nodes
        top = 1 << (nodes.bit_length() - 1)  # the largest power of two <= nodes
        if node >= top:  # folded into node - top, which sends the result back
            self._each_rail(lambda rail, lo, hi: rail.send(region[lo:hi], node - top, _FOLD))
            self._each_rail(lambda rail, lo, hi: rail.recv(region[lo:hi], node - top, _UNFOLD))
        else:
            folded = node + top < nodes
            if folded:
                self._each_rail(lambda rail, lo, hi: rail.recv(self.theirs[lo:hi], node + top, _FOLD))
                self._adasum(region, self.theirs)
            distance = 1
            while distance < top:
                partner = node ^ distance
                self._each_rail(lambda rail, lo, hi: rail.sendrecv(region[lo:hi], self.theirs[lo:hi], partner,
                                                                    _LEVEL))
                self._adasum(*((region, self.theirs) if node < partner else (self.theirs, region)))
                distance *= 2
            if folded:
                self._each_rail(lambda rail, lo, hi: rail.send(region[lo:hi], node + top, _UNFOLD))
        out = self.output(call, zeroed=False)
        self.allgather(out)
        self.last["k"] = self.size
        return out

    def _each_rail(self, call) -> None:
        for rail, (lo, hi) in zip(self.rails, self.spans):
            call(rail, lo, hi)

    def _adasum(self, a: Any, b: Any) -> None:
        """``region = adasum(a, b)`` over the node's whole vector (``a`` or ``b`` is
        ``region``); a is the lower node's."""
        xp, wa, wb = self.xp, self.wide_a, self.wide_b
        wa[...] = a
        wb[...] = b
        for i, (lo, hi) in enumerate(self.spans):
            x, y, product = wa[lo:hi], wb[lo:hi], self.product[lo:hi]
            for j, (u, v) in enumerate(((x, y), (x, x), (y, y))):
                xp.multiply(u, v, out=product)
                self.partials[3 * i + j] = product.sum()
        self.local.allgatherv(self.partials, self.all_partials, self.partial_counts)
        dot, aa, bb = 0.0, 0.0, 0.0
        for shard in self.memory.to_host(self.all_partials).reshape(-1, 3).tolist():  # in shard order
            dot, aa, bb = dot + shard[0], aa + shard[1], bb + shard[2]
        ca = 1.0 - dot / (2.0 * aa) if aa > 0 else 1.0
        cb = 1.0 - dot / (2.0 * bb) if bb > 0 else 1.0
        xp.multiply(wa, ca, out=wa)
        xp.multiply(wb, cb, out=wb)
        xp.add(wa, wb, out=wa)
        self.allgather.region[...] = wa
