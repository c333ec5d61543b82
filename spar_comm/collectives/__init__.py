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


def make_allreducer(
    algorithm: str,
    topology: Topology,
    size: int,
    dtype: Any = "float32",
    density: float = 0.001,
    selector: str = "mstopk",
    error_feedback: bool = True,
    average: bool = True,
    selector_options: Dict[str, Any] | None = None,
    shared_buffer: bool = False,
    values: str | None = None,
    indices: str | None = None,
    max_density: float | None = None,
    **options: Any,
) -> Allreducer:
    """An allreducer of ``algorithm`` for flat gradients of ``size`` elements.

    Collective: every rank of ``topology.world`` must call it. Settings are
    compared across ranks, and any bad or disagreeing setting raises
    ConfigError on every rank. ``algorithm`` is one of ``ALGORITHMS``:
    ``"auto"`` is the cost model's to resolve (``spar_comm.make_allreducer``).
    ``shared_buffer=True`` puts ``.buffer`` in the node's shared memory where
    the algorithm can read it without a copy (see ``Allreducer.buffer``).
    ``values`` narrows the values of the (index, value) pairs on the wire
    (``codecs.VALUES``; topka, hitopk and hitopk_leader), what they round
    away kept in the residual. ``indices="auto"`` sends their positions as
    int32, 16-bit gaps or a bitmap, whichever is smallest (``codecs.INDICES``).
    ``max_density`` (default ``density``) is the most a call may ask for
    (``allreduce(density=)``), by which the buffers are sized.
    ``options`` are an algorithm's own settings (``powersgd``: ``rank``,
    ``shapes``); another algorithm refuses them.
    """
    problem = unknown_algorithm(algorithm)
    if algorithm == AUTO:
        problem = ("algorithm='auto' is the cost model's choice, made above the allreducers: call "
                   "spar_comm.make_allreducer (spar_comm.costmodel.auto.make_allreducer)")
    # Patient: ranks may arrive from set-ups of their own.
    with waiting.watched(f"making the {algorithm} allreducer", topology.world, patient=True):
        raise_if_any(topology.world, problem)
        require_same(topology.world, "allreducer settings", {"algorithm": algorithm})
        cls = ALGORITHMS[algorithm]
        return cls(topology, size, dtype, density, selector, error_feedback, average, selector_options,
                   shared_buffer, values, indices, options, max_density)
