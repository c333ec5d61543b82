"""The training loop as a library and its HDF5 trace (docs/design.md, Training loop and Trace).

    from spar_comm.training import TrainConfig, train
    summary = train(TrainConfig(algorithm="hitopk", density=0.01, ranks_per_node=2))

The names below are loaded on first use (PEP 562), as in ``spar_comm``: the
readers (``read_trace``, ``TrainConfig``, ``build_model``) load no MPI.
"""
from __future__ import annotations

import importlib
from typing import Any, List

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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once loaded, a plain attribute
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))
