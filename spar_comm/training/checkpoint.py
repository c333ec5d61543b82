"""Checkpoints: one HDF5 file with everything a run needs to continue to the
same bits: parameters, optimizer state, the residual of every rank, the data
order, the step, a stateful density schedule's state (Accordion's), the
allreducer's shared state (PowerSGD's Q) and, under ``algorithm="auto"``,
the figures it priced (so that a resumed run chooses the same allreducers
however the link times then).

Rank 0 writes a temporary file and renames it over the old one, so a crash
while saving never loses the previous checkpoint; a write that fails (a full
disk) removes the temporary file and raises WriteError on every rank.

Checksums (format 2): the header before the HDF5 data holds a SHA-256 of the
whole file (``files.stamp``), checked before HDF5 parses any of it, since
HDF5 itself can crash or loop on a damaged file. Every dataset, group and
the root also carry a SHA-256 of their contents (``files.seal``), which
names what differs. Unlike HDF5's fletcher32 filter these cover attributes,
dtypes, shapes and which datasets there are, work on datasets of any layout
(fletcher32 needs chunked ones), and no edit through h5py updates them. On
resume every rank checks the whole file before restoring anything, and
reads its own residual back.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import array_api_compat
import numpy as np

from .. import __version__, waiting
from ..consensus import raise_if_any
from ..costmodel import auto
from ..errors import ConfigError, WriteError
from ..files import (BadFileError, agree, attribute, create_hdf5, dataset, finite, open_hdf5, seal, stamp, verify,
                     write_image)
from .config import TrainConfig
from .data import Shards
from .distributed import Group, to_host
from .layout import ParamLayout
from .state import TrainState

#: Format 2 added the checksums; format 1 files are refused, saying so.
FORMAT = 2
OLDER = (f"no checksum: a checkpoint of format 1 (or another program's HDF5 file); this version of spar_comm "
         f"reads format {FORMAT} only, so resume it with the version that wrote it, or start afresh")


def save_checkpoint(path: str, state: TrainState, *legacy: Any, **legacy_keywords: Any) -> None:
    """Write ``state`` (after ``state.step`` steps) to ``path``. Collective over
    ``state.group``.

    Every rank's residual and convergence-aids velocity are saved; the parts
    that are the same on every rank (parameters, optimizer, a stateful
    density schedule, the allreducer's shared state, ``auto``'s pricing) are
    saved from rank 0.

    The older form ``save_checkpoint(path, group, config, step, layout, params,
    velocity, reducer, shards, local_velocity=None, schedule=None,
    priced=None)`` still works, with a DeprecationWarning.
    """
    if not isinstance(state, TrainState):
        state = _legacy_state(state, *legacy, **legacy_keywords)
    elif legacy or legacy_keywords:
        raise TypeError("save_checkpoint(path, state) takes nothing more")
    group = state.group
    span, residual = state.allreduce.residual()
    with waiting.watched("Gather of the state to checkpoint", group.comm):
        # Pickled gather: once per checkpoint, never on the hot path.
        residuals = group.comm.gather((span, residual), root=0)
        local = group.comm.gather(None if state.local_velocity is None else to_host(state.local_velocity), root=0)
    problem = None
    if group.rank == 0:
        tmp = path + ".tmp"
        try:
            _write(tmp, state, residuals, local)
            os.replace(tmp, path)
        except OSError as error:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            problem = f"cannot write the checkpoint {path}: {error}; the previous one, if any, is intact"
    # Patient: the others wait here while rank 0 writes (and nobody leaves before the checkpoint is complete).
    with waiting.watched(f"rank 0 saving the checkpoint {path}", group.comm, patient=group.rank != 0):
        raise_if_any(group.comm, problem, WriteError)


def _legacy_state(group: Group, config: TrainConfig, step: int, layout: ParamLayout, params: Any, velocity: Any,
                  reducer: Any, shards: Shards, local_velocity: Any = None, schedule: Any = None,
                  priced: Optional[dict] = None) -> TrainState:
    """The ``TrainState`` that the twelve arguments of the older form describe."""
    warnings.warn("save_checkpoint(path, group, config, step, layout, params, velocity, reducer, shards, ...) is "
                  "deprecated: build a spar_comm.training.TrainState and call save_checkpoint(path, state)",
                  DeprecationWarning, stacklevel=3)
    pricing = None if priced is None else auto.resumed(group.topology, priced)
    return TrainState(group, config, layout, params, velocity, reducer, shards, schedule, pricing, local_velocity,
                      step)


def _write(tmp: str, state: TrainState, residuals: list, local: list) -> None:
    """Rank 0's part of ``save_checkpoint``: the whole file at ``tmp``, stamped."""
    group, config, layout, shards = state.group, state.config, state.layout, state.shards
    shared = state.allreduce.shared_state()  # the same on every rank: rank 0's is saved
    os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
    with create_hdf5(tmp, in_memory=True) as f:
        f.attrs.update(
            format=FORMAT, version=__version__, step=state.step, world_size=group.size, config=config.to_json(),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        )
        if state.pricing is not None:
            f.attrs["auto_priced"] = json.dumps(state.priced)
        for group_name, flat in (("params", state.params), ("optimizer/velocity", state.velocity)):
            host = to_host(flat)
            for name, (lo, hi) in layout.offsets.items():
                f.create_dataset(f"{group_name}/{name}", data=host[lo:hi].reshape(layout.shapes[name]))
        f["optimizer"].attrs.update(kind="sgd", momentum=config.momentum, weight_decay=config.weight_decay)
        for rank, ((lo, hi), values) in enumerate(residuals):
            f.create_dataset(f"residuals/rank{rank}", data=values).attrs.update(lo=lo, hi=hi)
        for rank, values in enumerate(local):
            if values is not None:
                f.create_dataset(f"aids/velocity/rank{rank}", data=values)
        if shared is not None:
            f.create_dataset("allreducer/shared", data=shared)
        schedule = state.schedule_state
        if schedule is not None:
            kept = f.create_group("schedule")
            kept.attrs.update(previous_norm=schedule["previous_norm"], density=schedule["density"])
            if schedule["accumulated"] is not None:
                kept.create_dataset("accumulated", data=to_host(schedule["accumulated"]))
        epoch, batch = shards.position(state.step)
        f.create_group("data").attrs.update(
            seed=shards.seed, epoch=epoch, batch=batch, steps_per_epoch=shards.steps_per_epoch,
            batch_size=shards.batch_size, world_size=shards.world,
        )
        seal(f)
        write_image(f, tmp)
    stamp(tmp)


#: The groups of per-parameter datasets, in the order Saved holds them.
GROUPS = ("params", "optimizer/velocity")


@dataclass
class Saved:
    """What a rank needs from a checkpoint, read and checked before anything is restored."""

    config: TrainConfig
    step: int
    world_size: int
    params: np.ndarray
    velocity: np.ndarray
    residual_span: Tuple[int, int]
    residual: Optional[np.ndarray]  # None on a rank the saving run did not have
    local_velocity: Optional[np.ndarray]  # the convergence aids' velocity, where the run had one
    schedule: Optional[dict] = None  # a stateful density schedule's state, where the run had one
    shared: Optional[np.ndarray] = None  # the allreducer's shared state (PowerSGD's Q), where it had one
    priced: Optional[dict] = None  # what algorithm="auto" priced, where the run used it


def read_checkpoint(path: str, rank: int, layout: ParamLayout) -> Saved:
    """Read what ``rank`` restores, checking the whole file (every rank's
    residual included, so every rank reaches the same verdict); a bad file
    raises BadFileError."""
    with open_hdf5(path, unstamped=OLDER) as f:
        version = attribute(f, "format", int)
        if version != FORMAT:
            raise BadFileError(path, f"checkpoint format {version}; this version of spar_comm reads format {FORMAT}")
        mine = [f"residuals/rank{rank}", f"aids/velocity/rank{rank}", "schedule/accumulated", "allreducer/shared"]
        values = verify(f, keep=[f"{group}/{name}" for group in GROUPS for name in layout.names] + mine)
        try:
            config = TrainConfig.from_json(attribute(f, "config", str))
        except (ValueError, TypeError) as error:
            raise BadFileError(path, f"attribute 'config' is not a training configuration ({error})") from None
        step, world = attribute(f, "step", int), attribute(f, "world_size", int)
        if step < 0 or world < 1:
            raise BadFileError(path, f"step {step} and world_size {world} must be >= 0 and >= 1")
        for group in GROUPS:
            for name in layout.names:
                dataset(f, f"{group}/{name}", "f", layout.shapes[name])
        flats = [np.concatenate([finite(path, f"{group}/{name}", values[f"{group}/{name}"]).reshape(-1)
                                 for name in layout.names]) for group in GROUPS]
        spans = {}
        for r in range(world):
            ds = dataset(f, f"residuals/rank{r}", "f", (None,))
            lo, hi = attribute(ds, "lo", int), attribute(ds, "hi", int)
            if not 0 <= lo <= hi <= layout.size or hi - lo != ds.shape[0]:
                raise BadFileError(path, f"residuals/rank{r} holds {ds.shape[0]} values for the range [{lo}, {hi}) "
                                         f"of {layout.size}")
            spans[r] = (lo, hi)
        residual = finite(path, mine[0], values[mine[0]]) if rank < world else None
        local = None
        if rank < world and mine[1] in f:
            dataset(f, mine[1], "f", (layout.size,))
            local = finite(path, mine[1], values[mine[1]])
        schedule = None
        if "schedule" in f:
            kept = f["schedule"]
            norm, density = attribute(kept, "previous_norm", float), attribute(kept, "density", float)
            if not (norm == -1 or norm >= 0) or not 0 < density <= 1:
                raise BadFileError(path, f"schedule: previous_norm {norm} and density {density} must be a norm "
                                         "(or -1: none yet) and a density in (0, 1]")
            accumulated = None
            if mine[2] in f:
                dataset(f, mine[2], "f", (layout.size,))
                accumulated = finite(path, mine[2], values[mine[2]])
            schedule = dict(accumulated=accumulated, previous_norm=norm, density=density)
        shared = None
        if mine[3] in f:
            dataset(f, mine[3], "f", (None,))
            shared = finite(path, mine[3], values[mine[3]])
        priced = _priced(path, attribute(f, "auto_priced", str)) if "auto_priced" in f.attrs else None
        return Saved(config, step, world, *flats, spans.get(rank, (0, 0)), residual, local, schedule, shared, priced)


def _priced(path: str, text: str) -> dict:
    """The ``auto_priced`` attribute, checked as ``auto.resumed`` will take it."""
    try:
        priced = json.loads(text)
        auto.from_state(priced)
    except (ValueError, KeyError, TypeError, RecursionError) as error:
        raise BadFileError(path, f"attribute 'auto_priced' is not what algorithm='auto' priced ({error})") from None
    return priced


def read_saved(path: str, group: Group, layout: ParamLayout) -> Saved:
    """``read_checkpoint`` on every rank, with rank 0's ``priced`` on every
    rank (so that all choose alike). Collective; a bad file is refused on
    every rank alike."""
    with waiting.watched(f"reading the checkpoint {path}", group.comm, patient=True):  # each rank reads it all
        saved = agree(group.comm, lambda: read_checkpoint(path, group.rank, layout))
        return dataclasses.replace(saved, priced=group.comm.bcast(saved.priced, root=0))


def load_checkpoint(saved: Saved, path: str, state: TrainState) -> None:
    """Restore ``saved`` (``read_saved`` of ``path``) into ``state`` in place,
    its ``step`` included.

    Collective. A checkpoint of other settings (ConfigError) is refused alike
    on every rank, and nothing is changed. A run with momentum correction
    restores the convergence aids' velocity, which the checkpoint must then
    hold; so must it a stateful density schedule's state.
    """
    config, group, schedule, reducer = state.config, state.group, state.schedule, state.allreduce
    changed = config.differences(saved.config)
    if changed:
        detail = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items()))
        raise ConfigError(f"cannot resume {path}: settings differ from the checkpoint's ({detail})")
    if saved.world_size != group.size:
        raise ConfigError(f"cannot resume {path}: saved by {saved.world_size} ranks, now {group.size}")
    restored = [(state.params, saved.params), (state.velocity, saved.velocity)]
    if state.local_velocity is not None:
        if saved.local_velocity is None:
            raise ConfigError(f"cannot resume {path}: it holds no local velocity for momentum correction")
        restored.append((state.local_velocity, saved.local_velocity))
    stateful = hasattr(schedule, "load_state_dict")
    if stateful and saved.schedule is None:
        raise ConfigError(f"cannot resume {path}: it holds no state for the density schedule")
    shared = reducer.shared_state()
    if (None if shared is None else shared.shape) != (None if saved.shared is None else saved.shared.shape):
        raise ConfigError(f"cannot resume {path}: the allreducer's shared state (PowerSGD's Q) does not fit this run")
    xp = array_api_compat.array_namespace(state.params)
    for flat, host in restored:
        flat[...] = xp.asarray(host, dtype=flat.dtype, device=array_api_compat.device(flat))
    reducer.load_residual(saved.residual_span, saved.residual)
    if saved.shared is not None:
        reducer.load_shared_state(saved.shared)
    if stateful:
        schedule.load_state_dict(saved.schedule, xp, like=state.params)
    state.step = saved.step
