"""How bench_peers.py's modes are built: DDP with each of torch's hooks (or
spar_comm's), spar_comm's DistributedOptimizer with each algorithm, over MPI
or over torch.distributed's group, and torch.distributed's default group
they need."""
from __future__ import annotations

import datetime
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from .. import torch as sct
from ..costmodel import auto
from ..costmodel.peers import MIN_COMPRESSION_RATE
from ..topology import Topology
from ..torch.world import launched
from .peer_fsdp import build_fsdp
from .peers import OUTER, OVER_TORCH, SHARDED, SPAR, SPINNING, Runner, PeerSettings, Workload, over_mpi, phases_of


def under_torchrun() -> bool:
    """Whether torchrun launched this job: each process an MPI world of one, in a job of several."""
    told = launched()
    return MPI.COMM_WORLD.size == 1 and told is not None and told.world_size != "1"


def start_torch(timeout: float, comm: Any = None) -> None:
    """torch.distributed's default group, where it is not up yet: over ``comm``'s
    ranks (an MPI launch), or from torchrun's environment (collective);
    ``timeout`` seconds for its collectives."""
    if not dist.is_initialized():
        sct.init_process_group("gloo", comm=comm, timeout=datetime.timedelta(seconds=timeout))


def build_ddp(mode: str, replica: torch.nn.Module, work: Workload, settings: PeerSettings,
              topology: Optional[Topology]) -> Runner:
    """DDP around ``replica`` on the default process group, with ``mode``'s hook
    (collective); ``topology`` is spar_comm's hook's."""
    cap = settings.bucket_cap_mb
    if mode.startswith("ddp_powersgd_r") and settings.powersgd_one_bucket:
        cap = max(cap, 1 + sum(p.numel() * p.element_size() for p in replica.parameters()) / 2**20)
    model = DistributedDataParallel(replica, bucket_cap_mb=cap)
    if mode == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif mode.startswith("ddp_powersgd_r"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(mode[len("ddp_powersgd_r"):]),
            start_powerSGD_iter=2, min_compression_rate=MIN_COMPRESSION_RATE, random_seed=settings.seed)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif mode == "spar_hook":
        model.register_comm_hook(*sct.comm_hook("hitopk", settings.density, selector=settings.selector,
                                                topology=topology))
    return Runner(model, work.new_optimizer(model.parameters()), lambda: None)


def build(mode: str, replica: torch.nn.Module, work: Workload, settings: PeerSettings, topology: Topology,
          over_torch: Callable[[], Topology]) -> Runner:
    """The runner of a mode that runs in this process (collective);
    ``over_torch`` gives the job's nodes over torch.distributed's group."""
    if mode == "no_comm":
        return Runner(replica, work.new_optimizer(replica.parameters()), lambda: 0.0)
    if mode in SHARDED:
        return build_fsdp(mode, replica, work, settings, over_torch())
    if mode in OUTER:
        return build_outer(mode, replica, work, settings, topology)
    if mode in OVER_TORCH:
        mode, topology = over_mpi(mode), over_torch()
    if mode == "spar_hook":
        start_torch(settings.peer_timeout, topology.world if topology.transport == "mpi" else None)  # DDP's own group
        return build_ddp(mode, replica, work, settings, topology)
    algorithm, values, indices = SPAR[mode]
    small = [name for name, p in replica.named_parameters() if p.numel() < (settings.dense_below or 0)]
    opt = sct.DistributedOptimizer(work.new_optimizer(replica.parameters()), replica.named_parameters(),
                                   algorithm=algorithm, density=settings.density, selector=settings.selector,
                                   topology=topology,
                                   bucket_cap_mb=settings.bucket_cap_mb, values=values, indices=indices, dense=small)
    chosen = ",".join(sorted({" ".join(filter(None, (b.reducer.name, b.reducer.settings.values))) for b in opt.buckets}))
    return Runner(replica, opt, lambda: float(sum(b.reducer.last["bytes_inter"] for b in opt.buckets)),
                  f"chose {chosen} ({opt.pricing.describe()})" if auto.chooses(algorithm, values) else "",
                  lambda: phases_of(opt), mode in SPINNING)


class LocalSteps:
    """The workload's optimizer taking each step alone, and the outer loop
    counting it: what a local-step mode's ``step()`` and ``zero_grad()`` do."""

    def __init__(self, inner: torch.optim.Optimizer, outer: sct.OuterLoop):
        self.inner, self.outer = inner, outer

    def zero_grad(self) -> None:
        self.inner.zero_grad()

    def step(self) -> None:
        self.inner.step()
        self.outer.step()


def build_outer(mode: str, replica: torch.nn.Module, work: Workload, settings: PeerSettings,
                topology: Topology) -> Runner:
    """A local-step mode (``OUTER``): the workload's optimizer on each rank,
    an outer step every ``settings.sync_every`` steps (collective). What it
    sends between nodes is counted on the steps that synchronise."""
    algorithm, values, lr, momentum, overlap = OUTER[mode]
    outer = sct.OuterLoop(replica.named_parameters(), settings.sync_every, algorithm=algorithm,
                          density=settings.outer_density or settings.density, selector=settings.selector,
                          values=values, indices="auto" if values and algorithm != "dense" else None, lr=lr,
                          momentum=momentum, bucket_cap_mb=settings.bucket_cap_mb,
                          overlap=settings.overlap_steps if overlap else 0, topology=topology)

    def sent() -> float:  # under overlap, the outer step's before, which finished in this one
        synced = outer.inner_steps == 0
        return float(sum(ledger["bytes_inter"] for ledger in outer.ledgers)) if synced else 0.0

    return Runner(replica, LocalSteps(work.new_optimizer(replica.parameters()), outer), sent,
                  outer.settings.describe() + (f", the mean taken {outer.overlap} inner steps late" if overlap else ""))
