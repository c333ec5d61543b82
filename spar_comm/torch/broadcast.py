"""Rank 0's weights and optimizer state on every rank, at start-up (Horovod's
``broadcast_parameters`` and ``broadcast_optimizer_state``)."""
from __future__ import annotations

from typing import Any, List, Optional

import torch
from mpi4py import MPI

from .. import waiting
from ..consensus import raise_if_any
from .world import job_comm, require_job_world


def broadcast_parameters(module: Any, root: int = 0, comm: Optional[MPI.Comm] = None) -> None:
    """Overwrite every parameter and buffer of ``module`` (an ``nn.Module``, or
    an iterable of (name, tensor)) with ``root``'s, in place. Collective; a
    rank whose tensors differ in name, shape or dtype from root's gets
    ConfigError on every rank, before anything is overwritten."""
    comm = comm or job_comm()
    require_job_world(comm, "spar_comm.torch.broadcast_parameters")
    named = list(module.state_dict().items()) if isinstance(module, torch.nn.Module) else list(module)
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    # Patient: at start-up, where ranks arrive after set-ups of their own.
    with waiting.watched("broadcast_parameters", comm, patient=True), torch.no_grad():
        reference = comm.bcast(layout, root=root)
        problem = None
        if layout != reference:
            problem = f"its tensors differ from rank {root}'s: {first_difference(layout, reference)}"
        raise_if_any(comm, problem)
        for _, tensor in named:
            host = tensor.detach().to("cpu").contiguous()  # a GPU tensor goes through the host: once, at start-up
            comm.Bcast(host.numpy(), root=root)
            if tensor.device.type != "cpu" or host.data_ptr() != tensor.data_ptr():
                tensor.copy_(host)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0,
                              comm: Optional[MPI.Comm] = None) -> None:
    """Give every rank ``root``'s optimizer state and hyper-parameters (the
    wrapped optimizer's own; residuals stay each rank's). Collective."""
    comm = comm or job_comm()
    require_job_world(comm, "spar_comm.torch.broadcast_optimizer_state")
    own = torch.optim.Optimizer.state_dict(optimizer) if comm.rank == root else None
    with waiting.watched("broadcast_optimizer_state", comm, patient=True):
        state = comm.bcast(own, root=root)  # pickled: once, at start-up
    problem = None
    if comm.rank != root:
        try:
            torch.optim.Optimizer.load_state_dict(optimizer, state)
        except (ValueError, KeyError, TypeError) as error:
            problem = f"cannot take rank {root}'s optimizer state: {error}"
    raise_if_any(comm, problem)


def first_difference(mine: List, reference: List) -> str:
    for a, b in zip(mine, reference):
        if a != b:
            return f"{a} where the reference has {b}"
    return f"{len(mine)} tensors where the reference has {len(reference)}"
