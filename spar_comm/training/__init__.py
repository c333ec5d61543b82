"""The training loop as a library and its HDF5 trace (docs/design.md, Training loop and Trace).

    from spar_comm.training import TrainConfig, train
    summary = train(TrainConfig(algorithm="hitopk", density=0.01, ranks_per_node=2))
"""
from .config import TrainConfig
from .checkpoint import save_checkpoint
from .loop import Summary, build_model, train
from .state import TrainState
from .trace import Trace, read_trace

__all__ = ["Summary", "Trace", "TrainConfig", "TrainState", "build_model", "read_trace", "save_checkpoint", "train"]
