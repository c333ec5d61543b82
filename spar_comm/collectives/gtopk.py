"""``gtopk``: gTop-k (Shi et al., ICDCS'19), a tree merge of top-k sets.

Every rank selects k pairs. Up a binomial tree (any rank count), a rank
receives its child's k pairs, sums the two sets on the union of their
indices and keeps the k of largest magnitude; the root broadcasts the final
k pairs. Every rank but the root sends its k pairs once up the tree, and
the root broadcasts k, whatever the world size.

Conservation is exact: a merge that drops an entry keeps that partial sum in
the merging rank's residual, so every value that does not reach the output
stays in some rank's residual (with error feedback on).
"""
from __future__ import annotations

from typing import Any, Tuple

from ..kernels import sorted_distinct
from .base import Allreducer
from .pairs import PairLayout
from .settings import Call
from .topk import selection_size

_TAG = 0x6770


class GTopKAllreducer(Allreducer):
    name = "gtopk"
    sparse = True

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.topk = self.top_k(self.size)
        self.layout = PairLayout(selection_size(self.density, self.size), self.dtype, self.xp)  # of the last call's k
        self.space = PairLayout(self.topk.k_most, self.dtype, self.xp).empty()  # room for a record of the most
        self.keep_largest = self.memory.selector("exact", {})  # the merge's pick
        self.feedback.cover(0, self.size)

    @property
    def widens_in_sweep(self) -> bool:
        return self.feedback.on and self.memory.in_host_memory

    def _reduce(self, grad: Any, call: Call) -> Any:
        in_place = call.output_is(grad)  # then the sweep that reads grad zeroes it for the result
        indices, values = self.topk.add_and_pick(grad, call, clear=in_place)
        if self.layout.k != len(indices):  # this call's density is another than the last call's
            self.layout = PairLayout(len(indices), self.dtype, self.xp)
        buf = self.space[: self.layout.nbytes]
        rank, p = self.world.rank, self.world.size
        step = 1
        while step < p:
            if rank % (2 * step) == step:
                self._pack(buf, indices, values)
                self.world.send(buf, rank - step, _TAG)
                break
            if rank + step < p:
                self.world.recv(buf, rank + step, _TAG)
                theirs = self.layout.views(buf)
                indices, values = self._merge(indices, values, theirs[1], theirs[0], call)
            step *= 2
        if rank == 0:
            self._pack(buf, indices, values)
        self.world.bcast(buf, root=0)
        values, indices = self.layout.views(buf)
        out = self.output(call, zeroed=not in_place)
        out[indices] = self.averaged(values)
        return out

    def _pack(self, buf: Any, indices: Any, values: Any) -> None:
        my_values, my_indices = self.layout.views(buf)
        my_values[:] = values
        my_indices[:] = indices

    def _merge(self, ia: Any, va: Any, ib: Any, vb: Any, call: Call) -> Tuple[Any, Any]:
        """Sum two sets on the union of their indices; keep the k largest, and put
        the dropped partial sums into this rank's residual."""
        xp = self.xp
        start = self.memory.now()
        union = sorted_distinct(xp.concatenate((ia, ib)))
        summed = xp.zeros(union.size, dtype=self.dtype)
        summed[xp.searchsorted(union, ia)] += va
        summed[xp.searchsorted(union, ib)] += vb
        keep = self.keep_largest(summed, self.layout.k)
        if self.error_feedback:
            dropped = xp.ones(union.size, dtype=bool)
            dropped[keep] = False
            call.feedback.residual[union[dropped]] += summed[dropped]
        self.last["t_select"] += self.memory.now() - start
        return union[keep], summed[keep]

