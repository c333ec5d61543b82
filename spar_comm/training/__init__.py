"""The training loop as a library and its HDF5 trace (docs/design.md, Training loop and Trace).

    from spar_comm.training import TrainConfig, train
    summary = train(TrainConfig(algorithm="hitopk", density=0.01, ranks_per_node=2))

The names below are loaded on first use (PEP 562), as in ``spar_comm``: the
readers (``read_trace``, ``TrainConfig``, ``build_model``) load no MPI.
"""
from __future__ import annotations

from ..lazy import exports

#: Each exported name -> the module that defines it.
_EXPORTS = {
    "Summary": ".loop",
    "Trace": ".trace",
    "TrainConfig": ".config",
    "TrainState": ".state",
    "build_model": ".models",
    "read_trace": ".trace",
    "save_checkpoint": ".checkpoint",
    "train": ".loop",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = exports(__name__, _EXPORTS, globals())
