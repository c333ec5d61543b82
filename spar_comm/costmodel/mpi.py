"""The cost of MPI collectives as MPICH runs them, counted in model terms.

A cost is a ``Terms`` mapping from a term name of ``machine.LINK_TERMS`` (or
``select:<method>``) to its amount: messages for ``alpha_*``, bytes for
``beta_*`` and ``gamma``, elements for ``select:*``. Time is the dot product
with a ``Machine`` (``Machine.seconds``); because the model is linear in the machine's figures,
fitting them to measurements is a least-squares problem (``calibrate.py``).

Ranks are numbered node by node, as MPI launchers place them. A step whose
partner lies on another node is an inter-node message; when several ranks
of a node send across at once they share the node's link, so such a step
costs ``alpha_inter + flows * bytes * beta_inter``. A step of a ring that
has both kinds of edge is paced by its inter-node edge.

Algorithm choice follows MPICH's long-standing defaults (CVARs in brackets):

| collective | short (bytes) | algorithm | long |
| --- | --- | --- | --- |
| Allreduce | <= 2048 [ALLREDUCE_SHORT_MSG_SIZE] | recursive doubling | Rabenseifner: reduce-scatter by recursive halving, nearest partner first, then allgather |
| Allgather | total < 524288 [ALLGATHER_LONG_MSG_SIZE] | recursive doubling | ring |
| Bcast | < 12288 or < 8 ranks [BCAST_SHORT_MSG_SIZE, BCAST_MIN_PROCS] | binomial tree | scatter + ring allgather |
| Reduce | <= 2048 [REDUCE_SHORT_MSG_SIZE] | binomial tree | Rabenseifner: reduce-scatter by recursive halving + binomial gather |

Counts of ranks that are not powers of two are costed with ceil(log2 p)
steps of the halving/doubling schedules.

The node's Reduce_scatter and Allgather are not MPI's: spar_comm moves them
through shared-memory windows (``shared_reduce_scatter``,
``shared_allgather``): reads instead of messages, and one fence each.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from ..collectives.channel import BCAST_MIN_PROCS, BCAST_SHORT

ALLREDUCE_SHORT = 2048
ALLGATHER_LONG = 524288
REDUCE_SHORT = 2048


class Terms(Counter):
    """Amounts of each model term (``+`` of two gives a plain Counter, which
    serves as well); ``Machine.seconds`` prices them."""


@dataclass(frozen=True)
class Span:
    """The ranks of one communicator: ``nodes`` nodes of ``per_node`` consecutive
    ranks, and ``concurrent`` such communicators using every node's link at
    the same time (the rails of a hierarchical algorithm)."""

    nodes: int
    per_node: int
    concurrent: int = 1

    @property
    def size(self) -> int:
        return self.nodes * self.per_node

    @property
    def steps(self) -> int:
        """Steps of a halving, doubling or binomial schedule."""
        return math.ceil(math.log2(self.size)) if self.size > 1 else 0

    def crosses(self, distance: int) -> bool:
        """Whether a partner ``distance`` ranks away is on another node."""
        return self.nodes > 1 and distance >= self.per_node


def message(terms: Terms, span: Span, nbytes: float, inter: bool, flows: int = 1, senders: int = 1) -> None:
    """One step that sends ``nbytes``; ``flows`` of the node's senders share its
    link, and ``senders`` ranks send in all (``host_inter`` counts the bytes
    every host's CPU pushes through its network stack)."""
    if inter:
        terms["alpha_inter"] += 1
        terms["beta_inter"] += flows * nbytes
        terms["host_inter"] += senders * nbytes
    else:  # through MPI's shared-memory buffers: copied in by the sender, out by the receiver
        terms["alpha_intra"] += 1
        terms["beta_intra"] += nbytes
        terms["gamma"] += 2 * nbytes


def _butterfly(terms: Terms, span: Span, sizes, distances, reduce: bool) -> None:
    """Recursive halving or doubling: every rank exchanges ``sizes[i]`` bytes
    with the partner ``distances[i]`` away; all ranks of a node send at once."""
    for nbytes, distance in zip(sizes, distances):
        message(terms, span, nbytes, span.crosses(distance), span.per_node * span.concurrent,
                span.size * span.concurrent)
        if reduce:
            terms["gamma"] += nbytes


def tree_senders(size: int, step: int) -> int:
    """Ranks sending in step ``step`` of a binomial tree over ``size`` ranks (the
    partners 2**step apart): one for every 2**(step+1) ranks."""
    return -(-size // 2 ** (step + 1))


def _binomial(terms: Terms, span: Span, sizes, reduce: bool) -> None:
    """A binomial tree; in a step across nodes one rank of a node sends."""
    for i, nbytes in enumerate(sizes):
        message(terms, span, nbytes, span.crosses(2**i), span.concurrent, tree_senders(span.size, i) * span.concurrent)
        if reduce:
            terms["gamma"] += nbytes


def _ring(terms: Terms, span: Span, block: float) -> None:
    """size-1 steps of one block; a node's boundary edge paces each step (one
    such edge leaves every node)."""
    for _ in range(span.size - 1):
        message(terms, span, block, span.nodes > 1, span.concurrent, span.nodes * span.concurrent)


def _halving(nbytes: float, steps: int):
    return [nbytes / 2 ** (i + 1) for i in range(steps)]


def allreduce(span: Span, nbytes: float) -> Terms:
    terms = Terms()
    p, steps = span.size, span.steps
    if p == 1:
        return terms
    near_first = [2**i for i in range(steps)]
    if nbytes <= ALLREDUCE_SHORT:
        _butterfly(terms, span, [nbytes] * steps, near_first, reduce=True)
    else:
        sizes = _halving(nbytes, steps)
        _butterfly(terms, span, sizes, near_first, reduce=True)   # reduce-scatter
        _butterfly(terms, span, sizes, near_first, reduce=False)  # allgather
    return terms


def shared_reduce_scatter(span: Span, nbytes: float) -> Terms:
    """spar_comm's own Reduce_scatter inside a node (``collectives/shm.py``). Each
    rank copies the (p-1)/p of its vector that others own into its slot of a
    shared window (a local pass); a fence; each owner then reads its shard's
    pieces from the other p-1 slots (intra-node bytes) and writes their sum.
    Simplified: the copy-in is charged even when the caller assembles its
    gradient in the shared buffer (the fitted gamma absorbs the difference),
    and one fence stands for the one per round (two with a shared buffer)."""
    p = span.size
    if p == 1:
        return Terms()
    return Terms(gamma=(p - 1) / p * nbytes + nbytes / p, beta_intra=(p - 1) / p * nbytes, alpha_intra=span.steps)


def shared_allgather(span: Span, nbytes: float) -> Terms:
    """spar_comm's own Allgather inside a node (``collectives/shm.py``): a fence,
    then each rank copies its own part of the ``nbytes`` vector out of the
    window (a local pass) and reads the other ranks' parts (intra-node bytes)."""
    p = span.size
    if p == 1:
        return Terms()
    return Terms(gamma=nbytes / p, beta_intra=(p - 1) / p * nbytes, alpha_intra=span.steps)


def allgather(span: Span, block: float) -> Terms:
    """Every rank contributes ``block`` bytes."""
    terms = Terms()
    p, steps = span.size, span.steps
    if p == 1:
        return terms
    if p * block < ALLGATHER_LONG:
        _butterfly(terms, span, [block * 2**i for i in range(steps)], [2**i for i in range(steps)], reduce=False)
    else:
        _ring(terms, span, block)
    return terms


def alltoall(span: Span, block: float) -> Terms:
    """Every rank sends ``block`` bytes to every other: MPICH's pairwise
    exchange, size-1 steps, in step i to the rank i away; a node's ranks
    whose partner lies on another node (i of them, at most all) share its link."""
    terms = Terms()
    for i in range(1, span.size):
        flows = min(i, span.per_node) * span.concurrent
        message(terms, span, block, span.nodes > 1, flows, flows * span.nodes)
    return terms


def bcast(span: Span, nbytes: float) -> Terms:
    terms = Terms()
    p = span.size
    if p == 1:
        return terms
    if nbytes < BCAST_SHORT or p < BCAST_MIN_PROCS:
        _binomial(terms, span, [nbytes] * span.steps, reduce=False)
    else:
        _binomial(terms, span, _halving(nbytes, span.steps), reduce=False)  # scatter
        _ring(terms, span, nbytes / p)
    return terms


def reduce(span: Span, nbytes: float) -> Terms:
    terms = Terms()
    p = span.size
    if p == 1:
        return terms
    if nbytes <= REDUCE_SHORT:
        _binomial(terms, span, [nbytes] * span.steps, reduce=True)
        return terms
    sizes = _halving(nbytes, span.steps)
    _butterfly(terms, span, sizes, [2**i for i in range(span.steps)], reduce=True)  # reduce-scatter
    _binomial(terms, span, sizes, reduce=False)  # gather to the root
    return terms
