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

from ..lazy import exports

#: Each exported name -> the module that defines it, loaded on first use: the
#: figures (``machine.py``), which a checkpoint's reader checks, load no MPI.
_EXPORTS = {
    **dict.fromkeys(("CPU", "GPU", "PRESETS", "Cluster", "Machine", "beta_to_gbps", "gbps_to_beta"), ".machine"),
    **dict.fromkeys(("CalibrationError", "Measurement", "fit", "load", "relative_errors", "save"), ".calibrate"),
    **dict.fromkeys(("STEPS", "step_terms"), ".algorithms"),
    **dict.fromkeys(("PARTS", "breakdown", "fastest", "predict"), ".prediction"),
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())
