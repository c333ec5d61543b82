"""Checkpoints: one HDF5 file with everything a run needs to continue to the
same bits: parameters, optimizer state, the residual of every rank, the data
order and the step.

Rank 0 writes a temporary file and renames it over the old one, so a crash
while saving never loses the previous checkpoint. Every rank reads its own
residual back.
"""
from __future__ import annotations

import datetime
import os
from typing import Any

import array_api_compat
import h5py
import numpy as np

from .. import __version__
from ..errors import ConfigError
from .config import TrainConfig
from .data import Shards
from .distributed import FusedAllreduce, Group, to_host
from .layout import ParamLayout

FORMAT = 1


def save_checkpoint(
    path: str, group: Group, config: TrainConfig, step: int, layout: ParamLayout,
    params: Any, velocity: Any, reducer: FusedAllreduce, shards: Shards, local_velocity: Any = None,
) -> None:
    """Write the state after ``step`` steps. Collective over the group.

    ``local_velocity`` is the convergence aids' per-rank velocity (aids.py),
    saved for every rank like the residuals."""
    span, residual = reducer.residual()
    # Pickled gather: once per checkpoint, never on the hot path.
    residuals = group.comm.gather((span, residual), root=0)
    local = group.comm.gather(None if local_velocity is None else to_host(local_velocity), root=0)
    if group.rank == 0:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with h5py.File(tmp, "w") as f:
            f.attrs.update(
                format=FORMAT, version=__version__, step=step, world_size=group.size, config=config.to_json(),
                created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            )
            for group_name, flat in (("params", params), ("optimizer/velocity", velocity)):
                host = to_host(flat)
                for name, (lo, hi) in layout.offsets.items():
                    f.create_dataset(f"{group_name}/{name}", data=host[lo:hi].reshape(layout.shapes[name]))
            f["optimizer"].attrs.update(kind="sgd", momentum=config.momentum, weight_decay=config.weight_decay)
            for rank, ((lo, hi), values) in enumerate(residuals):
                f.create_dataset(f"residuals/rank{rank}", data=values).attrs.update(lo=lo, hi=hi)
            for rank, values in enumerate(local):
                if values is not None:
                    f.create_dataset(f"aids/velocity/rank{rank}", data=values)
            epoch, batch = shards.position(step)
            f.create_group("data").attrs.update(
                seed=shards.seed, epoch=epoch, batch=batch, steps_per_epoch=shards.steps_per_epoch,
                batch_size=shards.batch_size, world_size=shards.world,
            )
        os.replace(tmp, path)
    group.comm.Barrier()  # nobody leaves before the checkpoint is complete


def load_checkpoint(
    path: str, group: Group, config: TrainConfig, layout: ParamLayout,
    params: Any, velocity: Any, reducer: FusedAllreduce, xp: Any, local_velocity: Any = None,
) -> int:
    """Restore the state in place; return the step to continue from.

    Every rank reads the same file, so a refusal (ConfigError) is alike on all.
    """
    with h5py.File(path, "r") as f:
        saved = TrainConfig.from_json(f.attrs["config"])
        changed = config.differences(saved)
        if changed:
            detail = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items()))
            raise ConfigError(f"cannot resume {path}: settings differ from the checkpoint's ({detail})")
        if int(f.attrs["world_size"]) != group.size:
            raise ConfigError(f"cannot resume {path}: saved by {f.attrs['world_size']} ranks, now {group.size}")
        for group_name, flat in (("params", params), ("optimizer/velocity", velocity)):
            host = np.concatenate([f[f"{group_name}/{name}"][...].reshape(-1) for name in layout.names])
            flat[...] = xp.asarray(host, dtype=flat.dtype, device=array_api_compat.device(flat))
        ds = f[f"residuals/rank{group.rank}"]
        reducer.load_residual((int(ds.attrs["lo"]), int(ds.attrs["hi"])), ds[...])
        if local_velocity is not None:
            if f"aids/velocity/rank{group.rank}" not in f:  # the same file on every rank: refused alike
                raise ConfigError(f"cannot resume {path}: it holds no local velocity for momentum correction")
            local_velocity[...] = xp.asarray(f[f"aids/velocity/rank{group.rank}"][...], dtype=local_velocity.dtype,
                                             device=array_api_compat.device(local_velocity))
        return int(f.attrs["step"])
