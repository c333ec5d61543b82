"""spar_comm: data-parallel training with top-k sparsified gradient communication.

    from spar_comm import Topology, make_allreducer
    topo = Topology(ranks_per_node=None)          # nodes found by shared memory
    ar = make_allreducer("hitopk", topo, size=n, density=0.001)
    mean_grad = ar.allreduce(flat_grad)           # identical bits on every rank

The names below are loaded on first use (PEP 562): importing the package, or
a reader of traces and checkpoints in it, loads neither MPI nor Numba, and
MPI initialises only when something collective is made.
"""
from __future__ import annotations

from .lazy import exports

__version__ = "0.1.0"

#: Each exported name -> the module that defines it.
_EXPORTS = {
    "ALGORITHMS": ".collectives",
    "Allreducer": ".collectives",
    "ConfigError": ".errors",
    "GradientError": ".errors",
    "NonFiniteGradientError": ".errors",
    "Residual": ".collectives.feedback",
    "SparCommError": ".errors",
    "Topology": ".topology",
    "make_allreducer": ".costmodel.auto",  # the allreducers' own, with algorithm="auto" resolved above them
    "retain_freed_memory": ".allocator",
    "selection_size": ".collectives",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())
