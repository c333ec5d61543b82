"""spar_comm: data-parallel training with top-k sparsified gradient communication.

    from spar_comm import Topology, make_allreducer
    topo = Topology(ranks_per_node=None)          # nodes found by shared memory
    ar = make_allreducer("hitopk", topo, size=n, density=0.001)
    mean_grad = ar.allreduce(flat_grad)           # identical bits on every rank
"""
from .allocator import retain_freed_memory
from .collectives import ALGORITHMS, Allreducer, selection_size
from .costmodel.auto import make_allreducer  # the allreducers' own, with algorithm="auto" resolved above them
from .collectives.feedback import Residual
from .errors import ConfigError, GradientError, NonFiniteGradientError, SparCommError
from .topology import Topology

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "Allreducer",
    "ConfigError",
    "GradientError",
    "NonFiniteGradientError",
    "Residual",
    "SparCommError",
    "Topology",
    "make_allreducer",
    "retain_freed_memory",
    "selection_size",
]
