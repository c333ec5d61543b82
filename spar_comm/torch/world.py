"""Which ranks spar_comm.torch works over, and the check that they are the job's.

The rule (``job_comm``): a ``torch.distributed`` group when torch.distributed
is initialised (the group given, else the default group), through
``transport.py``; MPI's world otherwise, or when ``transport="mpi"`` says so.

Under ``torchrun`` every process's MPI world is a world of one, with no error
from MPI. A hook or an optimizer that reduced over it would leave each replica
its own gradient, and the replicas would drift apart without a word. So every
way into ``spar_comm.torch`` first asks whether the communicator holds the
job's ranks, as the job declares them: ``torch.distributed``'s default group
when it is initialised, and ``WORLD_SIZE``/``RANK`` when a launcher set them
(torchrun does; ``mpiexec`` does not). A job that declares neither is an MPI
job, and MPI's world is its world.
"""
from __future__ import annotations

import os
from typing import Any, List, NamedTuple, Optional, Tuple

import torch
import torch.distributed as dist
from mpi4py import MPI

from ..consensus import raise_if_any
from ..device import device_index
from ..errors import ConfigError
from .transport import TorchComm

#: The values of ``transport=``: None picks by the rule above.
TRANSPORTS = (None, "mpi", "torch")

#: (ranks, this process's rank or None, what says so), one entry a source.
Declared = Tuple[int, Optional[int], str]


class Launched(NamedTuple):
    """What a launcher that numbers the processes itself (torchrun) set in
    this process's environment, as text; ``mpiexec`` sets none of it."""

    world_size: str  # WORLD_SIZE
    rank: str  # RANK
    local_rank: str  # LOCAL_RANK

    @property
    def local_index(self) -> Optional[int]:
        """LOCAL_RANK as a number, None where it is not one."""
        return int(self.local_rank) if self.local_rank.isdigit() else None


def launched() -> Optional[Launched]:
    """Whether torchrun (or a launcher like it: WORLD_SIZE set) started this
    process, and what it said; None under ``mpiexec`` or a bare ``python``.
    The one place spar_comm.torch asks."""
    world_size = os.environ.get("WORLD_SIZE", "").strip()
    if not world_size:
        return None
    return Launched(world_size, os.environ.get("RANK", "").strip(), os.environ.get("LOCAL_RANK", "").strip())


def declared_worlds() -> List[Declared]:
    """What this process was told of the job's ranks: by torch.distributed's
    default group, and by the launcher's WORLD_SIZE and RANK."""
    worlds: List[Declared] = []
    if dist.is_available() and dist.is_initialized():
        worlds.append((dist.get_world_size(), dist.get_rank(), "torch.distributed's default group"))
    told = launched()
    if told is not None:
        try:
            worlds.append((int(told.world_size), int(told.rank) if told.rank else None,
                           f"WORLD_SIZE={told.world_size}, as torchrun sets it"))
        except ValueError:
            worlds.append((-1, None, f"WORLD_SIZE={told.world_size!r} (RANK={told.rank!r}), not an integer"))
    return worlds


def size_problem(comm: MPI.Comm, what: str) -> Optional[str]:
    """Why ``comm`` is not the job's world by its size alone, or None. Local:
    every process of a job sees the same sizes."""
    for ranks, _, source in declared_worlds():
        if ranks != comm.size:
            plural = "rank" if comm.size == 1 else "ranks"
            return (f"{what} would work over MPI's world of {comm.size} {plural}, but this torch job has "
                    f"{ranks} ({source}): the ranks would not share their gradients. Initialise torch.distributed "
                    "first (spar_comm.torch then works over its group, unless transport='mpi'), or launch the "
                    f"script with `mpiexec -n {ranks if ranks > 0 else 'N'} python ...`")
    return None


def rank_problem(everyone: List[Optional[int]]) -> Optional[str]:
    """Why the torch ranks gathered over a communicator (``everyone[r]``: its
    rank r's torch rank, None where none is declared) are not its ranks once
    each, or None."""
    if all(r is None for r in everyone):
        return None
    if None not in everyone and sorted(everyone) == list(range(len(everyone))):
        return None
    pairs = ", ".join(f"MPI rank {m} is torch rank {t}" for m, t in enumerate(everyone))
    return f"MPI's world and the torch job hold different processes ({pairs})"


def require_job_world(comm: MPI.Comm, what: str) -> None:
    """ConfigError on every rank of ``comm`` unless it holds exactly the torch
    job's ranks (see the module's docstring). Collective over ``comm``."""
    problem = size_problem(comm, what)
    mine = sorted({r for _, r, _ in declared_worlds() if r is not None})
    if problem is None and len(mine) > 1:
        problem = f"{what}: this process has two torch ranks, {mine[0]} and {mine[1]} (RANK and the default group)"
    raise_if_any(comm, problem)
    if comm.size > 1:
        problem = rank_problem(comm.allgather(mine[0] if mine else None))
        if problem is not None:  # computed from the same gathered list on every rank
            raise ConfigError(f"{what}: {problem}")


def check_size(comm: MPI.Comm, what: str) -> None:
    """ConfigError unless ``comm``'s size is the torch job's (local, for calls that must not be collective)."""
    problem = size_problem(comm, what)
    if problem is not None:
        raise ConfigError(problem)


def job_comm(process_group: Any = None, transport: Optional[str] = None) -> Any:
    """The communicator spar_comm.torch works over (see the module's
    docstring): a ``TorchComm`` over ``process_group`` (default: torch's
    default group), or ``MPI.COMM_WORLD``. ConfigError for a transport that
    is unknown or cannot be had."""
    if transport not in TRANSPORTS:
        raise ConfigError(f"transport must be one of 'mpi', 'torch' or None, got {transport!r}")
    torch_up = dist.is_available() and dist.is_initialized()
    if transport == "mpi" or (transport is None and not torch_up):
        if process_group is not None:
            raise ConfigError("a process_group was given, but spar_comm.torch works over MPI here "
                              "(transport='mpi', or torch.distributed not initialised)")
        return MPI.COMM_WORLD
    if not torch_up:
        raise ConfigError("transport='torch' needs torch.distributed initialised first")
    return TorchComm.world(process_group)


def rank() -> int:
    """This process's rank among the ranks spar_comm.torch works over
    (``world.job_comm``): for a sampler, or to print once. ConfigError where
    they are not the torch job's."""
    comm = job_comm()
    check_size(comm, "spar_comm.torch.rank()")
    return comm.rank


def size() -> int:
    """The number of ranks spar_comm.torch works over (``world.job_comm``);
    ConfigError where they are not the torch job's."""
    comm = job_comm()
    check_size(comm, "spar_comm.torch.size()")
    return comm.size


def local_device() -> torch.device:
    """This rank's GPU as the GPU path picks it (its place among the ranks of
    its host, modulo the device count), or the CPU when CUDA is not available.
    ConfigError on every rank unless the ranks spar_comm.torch works over
    (``world.job_comm``) are the job's.

    The place is torchrun's ``LOCAL_RANK`` where torchrun launched the job
    (``WORLD_SIZE`` set too; no collective: an NCCL group cannot gather
    before each rank has set its device, which is what this answer is for),
    else found collectively over MPI's world where that holds the job's
    ranks (``mpiexec``), else over the group, which then must be able to
    gather (gloo, or NCCL once each rank has set its device)."""
    comm = job_comm()
    told = launched()
    if told is not None and told.local_index is not None:  # every rank sees the same sizes
        check_size(comm, "spar_comm.torch.local_device()")
        return torch.device("cuda", device_index(told.local_index, torch.cuda.device_count())) \
            if torch.cuda.is_available() else torch.device("cpu")
    ranks = MPI.COMM_WORLD if MPI.COMM_WORLD.size == comm.size else comm
    require_job_world(ranks, "spar_comm.torch.local_device()")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    host = ranks.Split_type(MPI.COMM_TYPE_SHARED, key=ranks.rank)
    index = device_index(host.rank, torch.cuda.device_count())
    host.Free()
    return torch.device("cuda", index)
