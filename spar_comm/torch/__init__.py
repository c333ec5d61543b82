"""PyTorch: sparsified gradient allreduce inside your own training script.

Two ways in, each a few lines in an existing script:

* ``DistributedOptimizer`` wraps a ``torch.optim`` optimizer (Horovod's
  shape; ``optimizer.py``);
* ``comm_hook`` gives a ``DistributedDataParallel`` model a communication
  hook (``ddp.py``), with ``init_process_group`` starting ``torch.distributed``
  from the MPI launch (``process_group.py``).

CUDA tensors go through the allreducers' GPU path, ordered by CUDA events
(``streams.py``). torch is imported only in this package.
"""
from .ddp import HookState, comm_hook
from .optimizer import (STATE_FORMAT, DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters,
                        local_device, rank, size)
from .process_group import init_process_group

__all__ = ["DistributedOptimizer", "HookState", "STATE_FORMAT", "broadcast_optimizer_state", "broadcast_parameters",
           "comm_hook", "init_process_group", "local_device", "rank", "size"]
