"""The allreduce algorithms, one module each, behind one interface."""
from __future__ import annotations

from typing import Any, Dict, Optional, Type

from .. import waiting
from ..consensus import raise_if_any, require_same
from ..topology import Topology
from .adasum import AdasumAllreducer
from .base import Allreducer
from .topk import selection_size
from .dense import DenseAllreducer
from .gtopk import GTopKAllreducer
from .hier_dense import HierDenseAllreducer
from .hitopk import HiTopKAllreducer
from .hitopk_leader import HiTopKLeaderAllreducer
from .powersgd import PowerSGDAllreducer
from .settings import Settings
from .topka import TopKAllgatherAllreducer

#: Algorithm name -> class.
ALGORITHMS: Dict[str, Type[Allreducer]] = {
    cls.name: cls
    for cls in (
        DenseAllreducer,
        HierDenseAllreducer,
        TopKAllgatherAllreducer,
        GTopKAllreducer,
        HiTopKAllreducer,
        HiTopKLeaderAllreducer,
        AdasumAllreducer,
        PowerSGDAllreducer,
    )
}

#: The algorithm name that lets the cost model choose, above the allreducers
#: (``spar_comm.costmodel.auto``; ``spar_comm.make_allreducer`` takes it).
AUTO = "auto"


def unknown_algorithm(algorithm: Any) -> Optional[str]:
    """Why ``algorithm`` names no allreducer (nor ``auto``), or None."""
    if algorithm == AUTO or (isinstance(algorithm, str) and algorithm in ALGORITHMS):
        return None
    return f"unknown algorithm {algorithm!r}; known: {', '.join([*ALGORITHMS, AUTO])}"


def build(algorithm: str, topology: Topology, size: int, dtype: Any, settings: Settings) -> Allreducer:
    """An allreducer of ``algorithm`` (one of ``ALGORITHMS``; ``auto`` is
    resolved above, by ``spar_comm.make_allreducer``) for flat gradients of
    ``size`` elements. Collective: a bad or disagreeing setting raises
    ConfigError on every rank."""
    problem = unknown_algorithm(algorithm)
    if algorithm == AUTO:
        problem = ("algorithm='auto' is the cost model's choice, made above the allreducers: call "
                   "spar_comm.make_allreducer")
    # Patient: ranks may arrive from set-ups of their own.
    with waiting.watched(f"making the {algorithm} allreducer", topology.world, patient=True):
        raise_if_any(topology.world, problem)
        require_same(topology.world, "allreducer settings", {"algorithm": algorithm})
        return ALGORITHMS[algorithm](topology, size, dtype, settings)
