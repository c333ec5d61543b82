"""``hitopk_leader``: the leader-based variant of hierarchical top-k.

local Reduce to the node leader -> the leader adds its residual and selects k
over the whole vector -> Allgather of (index, value) among the leaders ->
scatter-add -> local Bcast of the result. Simpler than ``hitopk`` but one
rank per node does all selection and all inter-node traffic.
"""
from __future__ import annotations

from typing import Any

from mpi4py import MPI

from .base import Allreducer
from .settings import Call


class HiTopKLeaderAllreducer(Allreducer):
    name = "hitopk_leader"
    sparse = True

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.local = self.channel(topology.local, spans_nodes=False)
        self.is_leader = topology.leader != MPI.COMM_NULL
        if self.is_leader:
            self.node_sum = self.xp.empty(self.size, dtype=self.dtype)
            self.topk = self.top_k(self.size)
            leaders = self.channel(topology.leader, spans_nodes=True)
            self.exchange = self.pair_exchange(leaders, self.topk)
            self.feedback.cover(0, self.size)

    def _reduce(self, grad: Any, call: Call) -> Any:
        node_sum = self.node_sum if self.is_leader else None
        self.local.reduce(grad, node_sum)
        out = self.output(call, zeroed=self.is_leader)
        if self.is_leader:
            acc = call.feedback.add(node_sum)
            indices, values = self.topk(acc, call)
            touched = self.exchange(indices, values, out, call.feedback, acc)
            self.averaged_at(out, touched)
        self.local.bcast(out)
        return out
