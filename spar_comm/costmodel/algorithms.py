"""The allreducers, step by step, as model terms.

Each function mirrors its module in ``spar_comm.collectives``: the MPI calls
it makes (costed by ``mpi.py``), the local memory passes it makes over the
vector (``gamma`` per byte: residual add, copies, zero fills, the final
average), the elements its selector scans, and the (index, value) pairs it
picks and scatter-adds (``pair`` each: random accesses). Every call also pays
the fixed ``overhead`` and the gradient check, a world Allgather of 4 bytes.

Selection happens on every rank in parallel, so a step pays one rank's
selection. Sizes of shards and of k follow ``selection_size`` exactly.

On an emulated cluster (``Cluster.cores``) the CPU-bound terms are stretched
by ``Cluster.contention`` and ``host_inter`` is shared by the cores; on a
real cluster ``host_inter`` is dropped (see ``machine.py``).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import numpy as np

from ..collectives.base import sum_dtype
from ..collectives.topk import selection_size
from ..collectives.codecs import make_codec, make_index_codec
from ..collectives.pairs import PairLayout, up8
from ..collectives.powersgd import plan as powersgd_plan
from . import mpi
from .machine import Cluster
from .mpi import Span, Terms

INDEX_BYTES = 4
#: A lossy value codec's work on the pairs, in passes over its values as
#: float32 (``gamma`` on 4 bytes each): encoding a rank's k values, and
#: decoding one record of k. Timed with NumPy on one core against a copy of
#: the same 650,000 values; float16's decode rebuilds float32's bits.
CODEC_PASSES = {"float16": (18, 46), "bfloat16": (9, 9), "int8": (11, 3.5)}


def pair_bytes(k: int, itemsize: int) -> int:
    """Bytes of a record of k (index, value) pairs, each part padded to 8 bytes."""
    return up8(k * itemsize) + up8(k * INDEX_BYTES)


class Shape:
    """One allreduce problem: the cluster, the vector, the selection, and the
    codecs of the pairs that cross nodes (``values``, ``indices``)."""

    def __init__(self, cluster: Cluster, size: int, itemsize: int, density: float, selector: str,
                 values: Optional[str] = None, indices: Optional[str] = None):
        self.nodes, self.g, self.p = cluster.nodes, cluster.ranks_per_node, cluster.ranks
        self.n, self.s = size, itemsize
        self.values, self.indices = values, indices
        self.codec = make_codec(values, np.dtype(f"f{itemsize}"), np)  # the values' codec, as the allreducer makes it
        self.nbytes = size * itemsize
        self.density, self.selector = density, selector
        self.world = Span(self.nodes, self.g)
        self.local = Span(1, self.g)
        self.rails = Span(self.nodes, 1, concurrent=self.g)  # one rail per local rank, all at once
        self.leaders = Span(self.nodes, 1)

    def select(self, elements: float, k: int, selector: Optional[str] = None) -> Terms:
        """One call of ``selector`` (the allreducer's by default) over
        ``elements`` that picks ``k`` pairs."""
        name = selector or self.selector
        return Terms({f"select_call:{name}": 1, f"select:{name}": elements, "pair": k})

    def pairs(self, k: int) -> int:
        return pair_bytes(k, self.s)

    @property
    def lossy(self) -> bool:
        """Whether the value codec rounds (and dense sums go through ``sums.py``)."""
        return self.codec.lossy

    def coded_sum(self, span: Span, length: int) -> Terms:
        """``sums.py``'s coded sum of ``length`` elements over ``span``: an Alltoall and an
        Allgather of a chunk's encoded bytes, and about ten local passes (the
        residual add, the copy into chunks, encoding, decoding what this rank
        sent and what it got, the rounding kept, the sum, the output)."""
        chunk = math.ceil(length / span.size)
        block = up8(self.codec.nbytes(chunk))
        return Terms(gamma=10 * length * self.s) + mpi.alltoall(span, block) + mpi.allgather(span, block)

    def code(self, k: int, records: int) -> Terms:
        """The value codec's work on k pairs: encoding this rank's, decoding ``records`` records."""
        encode, decode = CODEC_PASSES.get(self.values, (0, 0)) if self.lossy else (0, 0)
        return Terms(gamma=(encode + records * decode) * k * 4)

    def wire(self, k: int, span: int) -> int:
        """Bytes of a record of k pairs within ``span`` through the codecs (``pairs`` without them)."""
        if self.values is None and self.indices is None:
            return self.pairs(k)
        return PairLayout(k, self.codec.dtype, np, self.codec, make_index_codec(self.indices, k, span, np)).nbytes


def dense(x: Shape) -> Terms:
    if x.lossy:
        return x.coded_sum(x.world, x.n)
    return Terms(gamma=x.nbytes) + mpi.allreduce(x.world, x.nbytes)  # copy, then Allreduce


def hier_dense(x: Shape) -> Terms:
    shard = x.nbytes / x.g
    rails = x.coded_sum(x.rails, math.ceil(x.n / x.g)) if x.lossy else mpi.allreduce(x.rails, shard)
    return mpi.shared_reduce_scatter(x.local, x.nbytes) + rails + mpi.shared_allgather(x.local, x.nbytes)


def topka(x: Shape) -> Terms:
    k = selection_size(x.density, x.n)
    local = Terms(gamma=2 * x.nbytes + x.p * x.wire(k, x.n), pair=x.p * k)  # residual add, zero fill, scatter-add
    return local + x.code(k, x.p) + x.select(x.n, k) + mpi.allgather(x.world, x.wire(k, x.n))


def merge(x: Shape, k: int) -> Terms:
    """One gTop-k merge of two sets of k pairs (``GTopKAllreducer._merge``):
    sort the union of their indices (a pair's time each), place both sets in
    it by binary search (two each) and add them (one each), keep the k
    largest (an exact selection), and add the dropped back into the residual
    (at most k, one each). Measured alone on this package's CPU kernels, about
    60 ns a pair in; the CPU preset's figures price it at about 77."""
    return Terms(gamma=2 * x.pairs(k), pair=2 * k + 4 * k + 2 * k + k) + x.select(2 * k, k, "exact")


def gtopk(x: Shape) -> Terms:
    k = selection_size(x.density, x.n)
    terms = Terms(gamma=2 * x.nbytes, pair=k) + x.select(x.n, k)  # residual add, zero fill, the result's pairs
    for i in range(x.world.steps):  # the root's path up the binomial tree: receive and merge
        mpi.message(terms, x.world, x.pairs(k), x.world.crosses(2**i), senders=mpi.tree_senders(x.p, i))
        terms += merge(x, k)
    return terms + mpi.bcast(x.world, x.pairs(k))


def hitopk(x: Shape) -> Terms:
    shard = math.ceil(x.n / x.g)
    k = selection_size(x.density, shard)
    terms = mpi.shared_reduce_scatter(x.local, x.nbytes) + x.select(shard, k)
    if x.g == 1:  # the residual add, and the zero fill of the output (the rank is its node)
        terms["gamma"] += shard * x.s + x.nbytes
    terms["gamma"] += x.nodes * x.wire(k, shard) + x.g * x.pairs(k)  # decoding, scatter-adds
    terms["pair"] += x.nodes * k
    terms += x.code(k, x.nodes) + mpi.allgather(x.rails, x.wire(k, shard))
    return terms + mpi.shared_allgather(x.local, x.nbytes)


def hitopk_leader(x: Shape) -> Terms:
    k = selection_size(x.density, x.n)
    terms = mpi.reduce(x.local, x.nbytes) + x.select(x.n, k)
    terms["gamma"] += 2 * x.nbytes + x.nodes * x.wire(k, x.n)  # residual add, zero fill, scatter-add
    terms["pair"] += x.nodes * k
    return terms + x.code(k, x.nodes) + mpi.allgather(x.leaders, x.wire(k, x.n)) + mpi.bcast(x.local, x.nbytes)


#: Local passes over a shard's bytes per adaptive sum: widen both vectors to
#: float64, three products and their sums, the combination and its cast.
ADASUM_PASSES = 12
#: Bytes of one shard's partial products (a.b, |a|^2, |b|^2 in float64).
ADASUM_PARTIALS = 24


def adasum(x: Shape) -> Terms:
    shard = x.nbytes / x.g
    levels = x.nodes.bit_length() - 1
    folds = x.nodes - 2**levels
    terms = mpi.shared_reduce_scatter(x.local, x.nbytes) + mpi.shared_allgather(x.local, x.nbytes)
    if x.g > 1:
        terms["gamma"] += shard  # the division by the node's size
    combines = levels + (1 if folds else 0)
    for _ in range(levels):  # every rank swaps its shard with the partner node's owner
        mpi.message(terms, x.rails, shard, inter=True, flows=x.g, senders=x.p)
    for _ in range(2 if folds else 0):  # the extra nodes' shards in, and the results back out
        mpi.message(terms, x.rails, shard, inter=True, flows=x.g, senders=folds * x.g)
    for _ in range(combines):
        terms += mpi.allgather(x.local, ADASUM_PARTIALS)
        terms["gamma"] += ADASUM_PASSES * shard
    return terms


def powersgd(x: Shape) -> Terms:
    """Rank 1 over the vector as one matrix (the allreducer's defaults): two
    world Allreduces of the factors, and about six passes over the vector
    (residual add, the two products, the result, the residual update, the
    average), the products' arithmetic taken as memory-bound at rank 1."""
    matrices, dense_parts = powersgd_plan(x.n, 1, None)
    terms = Terms(gamma=6 * x.nbytes)
    terms += mpi.allreduce(x.world, sum(rows for _, rows, _ in matrices) * x.s)
    terms += mpi.allreduce(x.world, sum(cols for _, _, cols in matrices) * x.s)
    if dense_parts:
        terms += mpi.allreduce(x.world, sum(n for _, n in dense_parts) * x.s)
    return terms


#: Algorithm name -> its step terms, in the order of spar_comm.ALGORITHMS.
STEPS: Dict[str, Callable[[Shape], Terms]] = {
    f.__name__: f for f in (dense, hier_dense, topka, gtopk, hitopk, hitopk_leader, adasum, powersgd)
}


def step_terms(algorithm: str, cluster: Cluster, size: int, dtype: str = "float32",
               density: float = 0.001, selector: str = "mstopk", values: Optional[str] = None,
               indices: Optional[str] = None) -> Terms:
    """All the terms of one allreduce call of ``algorithm`` (a 16-bit gradient is
    reduced and sent in float32, so it costs as one); ``values`` and ``indices``
    are the codecs of the messages (``checks.CODECS``)."""
    x = Shape(cluster, size, sum_dtype(dtype).itemsize, density, selector, values, indices)
    common = Terms(overhead=1, gamma=x.nbytes) + mpi.allgather(x.world, 4)  # check, final average
    return on_cores(common + STEPS[algorithm](x), cluster)


#: Terms that are work of a rank's CPU (selection terms too), as opposed to a link's.
CPU_TERMS = ("overhead", "gamma", "pair", "alpha_intra", "alpha_inter", "beta_intra")


def on_cores(terms: Terms, cluster: Cluster) -> Terms:
    """``terms`` as the cluster's cores pay them: unchanged, without host network
    work, on a real cluster; stretched by the ranks sharing a core, and the
    network work of all hosts spread over the cores, on an emulated one."""
    placed = Terms()
    for term, amount in terms.items():
        if term == "host_inter":
            if cluster.cores:
                placed[term] = amount / cluster.cores
        elif term in CPU_TERMS or term.startswith("select"):
            placed[term] = amount * cluster.contention
        else:
            placed[term] = amount
    return placed
