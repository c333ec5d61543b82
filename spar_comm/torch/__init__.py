"""PyTorch: sparsified gradient allreduce inside your own training script.

The ways in, each a few lines in an existing script:

* ``DistributedOptimizer`` wraps a ``torch.optim`` optimizer (Horovod's
  shape; ``optimizer.py``);
* ``comm_hook`` gives a ``DistributedDataParallel`` model a communication
  hook (``ddp.py``), with ``init_process_group`` starting ``torch.distributed``
  from the MPI launch (``process_group.py``);
* ``OuterLoop`` synchronises the ranks every H inner steps of the user's own
  optimizer by their pseudo-gradients (DiLoCo, SparseLoCo; ``outer_loop.py``);
* ``hsdp_hook`` reduces an FSDP2 model's shards between nodes (HSDP; ``fsdp.py``),
  sharded inside each node on ``node_mesh()``.

``save_checkpoint`` / ``load_checkpoint`` save through
``torch.distributed.checkpoint`` and resume on any number of ranks
(``checkpoint.py``).

CUDA tensors go through the allreducers' GPU path, ordered by CUDA events
(``streams.py``). torch is imported only in this package.
"""
from .broadcast import broadcast_optimizer_state, broadcast_parameters
from .checkpoint import Resumed, load_checkpoint, save_checkpoint
from .ddp import HookState, comm_hook
from .fsdp import HSDPState, hsdp_hook, node_mesh
from .optimizer import DistributedOptimizer
from .outer_loop import OUTER_STATE_FORMAT, OuterLoop
from .process_group import destroy_process_group, init_process_group
from .state import STATE_FORMAT
from .world import local_device, rank, size

__all__ = ["DistributedOptimizer", "HSDPState", "HookState", "OUTER_STATE_FORMAT", "OuterLoop", "Resumed",
           "STATE_FORMAT", "broadcast_optimizer_state", "broadcast_parameters", "comm_hook", "destroy_process_group",
           "hsdp_hook", "init_process_group", "load_checkpoint", "local_device", "node_mesh", "rank",
           "save_checkpoint", "size"]
