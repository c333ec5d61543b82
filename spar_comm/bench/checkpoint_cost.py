"""What a checkpoint costs each rank (bench_checkpoint.py): save and load
time through the library's ``save_checkpoint``, ``read_saved`` and
``load_checkpoint``, and how much a rank's resident memory grows while it
saves, against the state it holds: whether a save costs a rank its own
state or the world's."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Dict, Optional

import numpy as np

from ..training import checkpoint
from ..training.aids import ScheduledAllreduce
from ..training.config import TrainConfig
from ..training.data import Shards
from ..training.density import make_schedule
from ..training.distributed import Group
from ..training.layout import ParamLayout
from ..training.state import TrainState
from .resources import PeakRSS
from .timing import slowest

FIGURES = ("save_s", "load_s", "growth_kib")


def build_state(group: Group, size: int, algorithm: str) -> Dict[str, Any]:
    """A run's state on this rank, as a ``TrainState``'s fields: arrays of the
    given size, a residual from one real call of ``algorithm``."""
    layout = ParamLayout([("w", (size,))])
    config = TrainConfig(algorithm=algorithm, density=0.001, selector="exact", trace="")
    rng = np.random.default_rng(group.rank)
    schedule = make_schedule("fixed", 0.001, 100)
    allreduce = ScheduledAllreduce(group, algorithm, size, "float32", "exact", schedule)
    allreduce.reduce(0, rng.standard_normal(size).astype(np.float32), np)
    params, velocity, local = (rng.standard_normal(size).astype(np.float32) for _ in range(3))
    return dict(group=group, config=config, layout=layout, params=params, velocity=velocity, allreduce=allreduce,
                shards=Shards(100 * group.size, group.rank, group.size, 1, 0), schedule=schedule,
                local_velocity=local, step=5)


def state_kib(parts: Dict[str, Any]) -> int:
    """What the rank holds of the run: parameters, velocity, the aids' velocity and its residual."""
    return (sum(parts[name].nbytes for name in ("params", "velocity", "local_velocity"))
            + parts["allreduce"].residual()[1].nbytes) // 1024


def measure(group: Group, parameters: int, algorithm: str, repeat: int, folder: Optional[str] = None) -> Optional[dict]:
    """Save and load a state of ``parameters`` parameters ``repeat`` times in
    ``folder`` (default: a temporary one, removed after), collectively. On
    rank 0 the medians of the slowest rank's save and load seconds and
    memory growth, every rank's largest growth, and the state; None on the others."""
    world = group.topology.world
    parts = build_state(group, parameters, algorithm)
    held = state_kib(parts)
    made = folder or (tempfile.mkdtemp(prefix="bench_checkpoint-") if world.rank == 0 else None)
    made = world.bcast(made, root=0)
    rows = np.zeros((repeat, len(FIGURES)))
    try:
        for i in range(repeat):
            path = os.path.join(made, f"ck{i}.h5")
            world.Barrier()
            began = time.perf_counter()
            with PeakRSS() as memory:
                checkpoint.save_checkpoint(TrainState(**parts), path)
            saved = time.perf_counter()
            world.Barrier()
            load_began = time.perf_counter()
            checkpoint.load_checkpoint(checkpoint.read_saved(path, group, parts["layout"]), path, TrainState(**parts))
            rows[i] = (saved - began, time.perf_counter() - load_began, memory.growth)
    finally:
        world.Barrier()
        if world.rank == 0 and folder is None:
            shutil.rmtree(made, ignore_errors=True)
    worst = slowest(world, rows)
    growths = world.gather(rows[:, 2].max(), root=0)
    if world.rank != 0:
        return None
    medians = dict(zip(FIGURES, np.median(worst, axis=0).tolist()))
    return {**medians, "state_kib": held, "growth_per_rank_kib": growths, "growth_over_state": max(growths) / held}
