"""PyTorch: sparsified gradient allreduce inside your own training script.

``DistributedOptimizer`` wraps a ``torch.optim`` optimizer (Horovod's shape);
see ``optimizer.py``. torch is imported only in this package.
"""
from .optimizer import (STATE_FORMAT, DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters, rank,
                        size)

__all__ = ["DistributedOptimizer", "STATE_FORMAT", "broadcast_optimizer_state", "broadcast_parameters", "rank",
           "size"]
