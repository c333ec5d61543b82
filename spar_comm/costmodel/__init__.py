"""Per-step communication time of every allreducer, from alpha-beta-gamma terms.

    from spar_comm.costmodel import Cluster, GPU, predict, fastest
    times = predict(Cluster(nodes=16, ranks_per_node=8), size=25_600_000,
                    machine=GPU.with_links(inter_gbps=25), density=0.001)
    fastest(times)                                  # e.g. 'hitopk'

``mpi.py`` costs MPI collectives as MPICH runs them, ``algorithms.py`` the
allreducers step by step, ``machine.py`` holds the figures and
``calibrate.py`` fits them to bench_comm.py/bench_topk.py measurements.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional

from ..collectives import ALGORITHMS
from ..collectives.checks import CODECS
from .algorithms import STEPS, step_terms
from .calibrate import CalibrationError, Measurement, fit, load, relative_errors, save
from .machine import CPU, GPU, PRESETS, Cluster, Machine, beta_to_gbps, gbps_to_beta

#: The parts of a step, by the prefix of the terms they sum.
PARTS = {"select": ("select",), "intra": ("alpha_intra", "beta_intra"),
         "inter": ("alpha_inter", "beta_inter", "host_inter"),
         "local": ("gamma", "pair", "overhead")}


def predict(cluster: Cluster, size: int, machine: Machine, dtype: str = "float32", density: float = 0.001,
            selector: str = "mstopk", algorithms: Optional[Iterable[str]] = None, values: Optional[str] = None,
            indices: Optional[str] = None) -> Dict[str, float]:
    """Predicted seconds per allreduce call of each algorithm (default: all; with
    ``values`` or ``indices``, all that take those codecs)."""
    if selector not in machine.select:
        raise ValueError(f"no selection figure for selector {selector!r}; known: {', '.join(sorted(machine.select))}")
    default = CODECS["indices"] if indices else CODECS["values"] if values else STEPS
    return {
        name: machine.seconds(step_terms(name, cluster, size, dtype, density, selector, values, indices))
        for name in (algorithms or default)
    }


def breakdown(algorithm: str, cluster: Cluster, size: int, machine: Machine, dtype: str = "float32",
              density: float = 0.001, selector: str = "mstopk", values: Optional[str] = None,
              indices: Optional[str] = None) -> Dict[str, float]:
    """Seconds of one call split into select, intra, inter and local work."""
    terms = step_terms(algorithm, cluster, size, dtype, density, selector, values, indices)
    return {
        part: machine.seconds({t: a for t, a in terms.items() if t.startswith(prefixes)})
        for part, prefixes in PARTS.items()
    }


def fastest(times: Dict[str, float]) -> str:
    """The algorithm of least predicted time; ties go to the one listed first.
    Only algorithms that return the sum compete (``adasum`` changes the
    update, so it is priced but never picked), unless none is listed."""
    summing = [name for name in times if name not in ALGORITHMS or ALGORITHMS[name].sums]
    return min(summing or times, key=lambda name: times[name])


__all__ = [
    "CPU", "GPU", "PRESETS", "CalibrationError", "Cluster", "Machine", "Measurement", "STEPS",
    "beta_to_gbps", "breakdown", "fastest", "fit", "gbps_to_beta", "load", "predict", "relative_errors",
    "save", "step_terms",
]
