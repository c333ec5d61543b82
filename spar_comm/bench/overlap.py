"""How much gradient communication spar_comm.torch hides behind backward
(bench_overlap.py): an MLP trains the same steps twice over, once with the
buckets reduced on the communication thread while backward runs (overlap),
once with every bucket reduced after backward (sync), the two alternating
step by step; the hidden share is (sync step - overlap step) over what the
sync run waits in synchronize()."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, List

import numpy as np
import torch

from .. import torch as sct
from ..topology import Topology
from ..workloads.mlp import mlp
from .timing import slowest_median

MODES = ("overlap", "sync")
#: Per step: step, forward+backward, time waited in synchronize.
FIGURES = ("step", "backward", "wait")


@dataclass(frozen=True)
class OverlapSettings:
    """The MLP (``inputs`` wide, ``layers`` hidden-to-hidden layers of
    ``hidden``), its batch per rank, spar_comm's density and buckets, and the
    steps of each mode, untimed and timed."""

    inputs: int
    hidden: int
    layers: int
    batch_size: int
    density: float
    bucket_cap_mb: float
    warmup: int
    repeat: int


def timed_step(model: torch.nn.Module, opt: Any, x: torch.Tensor, y: torch.Tensor) -> List[float]:
    """One training step: its time, forward+backward, and the wait in synchronize."""
    start = time.perf_counter()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    backward = time.perf_counter() - start
    opt.step()
    return [time.perf_counter() - start, backward, opt.last_wait]


def measure(settings: OverlapSettings, algorithm: str, topology: Topology) -> dict:
    """Both modes with ``algorithm`` (collective): each mode's medians, the
    communication, backward and the share hidden."""
    runs = {}
    for mode in MODES:
        model = mlp(settings.inputs, settings.hidden, settings.layers)
        opt = sct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3), model.named_parameters(),
                                       algorithm=algorithm, density=settings.density, topology=topology,
                                       bucket_cap_mb=settings.bucket_cap_mb, overlap=mode == "overlap")
        runs[mode] = (model, opt)
    rng = np.random.default_rng(topology.world.rank)
    x = torch.from_numpy(rng.standard_normal((settings.batch_size, settings.inputs)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 10, settings.batch_size))
    rows = np.zeros((len(MODES), settings.repeat, len(FIGURES)))
    for i in range(settings.warmup + settings.repeat):
        for m, mode in enumerate(MODES):
            topology.world.Barrier()
            figures = timed_step(*runs[mode], x, y)
            if i >= settings.warmup:
                rows[m, i - settings.warmup] = figures
    medians = {mode: dict(zip(FIGURES, figures.tolist()))
               for mode, figures in zip(MODES, slowest_median(topology.world, rows, axis=1))}
    comm = medians["sync"]["wait"]
    saved = medians["sync"]["step"] - medians["overlap"]["step"]
    model, opt = runs["overlap"]
    return dict(
        algorithm=algorithm, parameters=sum(p.numel() for p in model.parameters()), buckets=len(opt.buckets),
        overlap=medians["overlap"], sync=medians["sync"], communication=comm, backward=medians["sync"]["backward"],
        hidden=saved / comm if comm > 0 else 0.0,
    )
