"""Checkpoints: everything a run needs to continue to the same bits
(parameters, optimizer state, every rank's residual, the data order, the
step, a stateful density schedule's state, the allreducer's shared state
(PowerSGD's Q) and, under ``algorithm="auto"``, the figures it priced, so
that a resumed run chooses as the run it continues), or to continue on
another number of ranks with the residuals' total kept.

Format 3: each rank writes its own part (its residual and convergence aids'
velocity, ``parts.py``), in parallel; rank 0 then writes the checkpoint file
itself: what every rank holds alike and the manifest (every part's span and
checksum), to a temporary file renamed over the old one. A crash while
saving never loses the previous checkpoint, and a write that fails (a full
disk) raises WriteError on every rank. Format 2 (one file with every
residual) is still read.

Checksums: the header before the HDF5 data holds a SHA-256 of the whole
file (``files.stamp``), checked before HDF5 parses any of it, since HDF5
itself can crash or loop on a damaged file. Every dataset, group and the
root also carry a SHA-256 of their contents (``files.seal``), which names
what differs. Unlike HDF5's fletcher32 filter these cover attributes,
dtypes, shapes and which datasets there are, work on datasets of any layout
(fletcher32 needs chunked ones), and no edit through h5py updates them. On
resume every rank checks the checkpoint file whole and the parts it reads.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import array_api_compat
import numpy as np

from .. import __version__, redistribute, waiting
from ..consensus import raise_if_any
from ..errors import ConfigError, WriteError
from ..files import (BadFileError, agree, attribute, create_hdf5, dataset, finite, open_hdf5, seal, stamp, verify,
                     write_image)
from ..costmodel.machine import from_state
from .config import TrainConfig
from . import parts
from .layout import ParamLayout

if TYPE_CHECKING:  # a run's, which loads MPI: a reader of checkpoints needs neither
    from .distributed import Group
    from .state import TrainState

#: Format 3: a part per rank; 2 (read still): every residual in the one file,
#: the first with checksums; format 1 files are refused, saying so.
FORMAT = 3
READS = (2, 3)
OLDER = (f"no checksum: a checkpoint of format 1 (or another program's HDF5 file); this version of spar_comm "
         f"reads formats {READS[0]} and {READS[1]}, so resume it with the version that wrote it, or start afresh")


def save_checkpoint(state: TrainState, path: str) -> None:
    """Write ``state`` (after ``state.step`` steps) to ``path``. Collective over
    ``state.group``: every rank writes its own part, rank 0 the rest. State
    first, as ``spar_comm.torch.save_checkpoint(state, directory, step)``."""
    from .distributed import to_host  # a run's arrays, on its device: loaded by a save, not by a reader

    group = state.group
    with waiting.watched("Bcast of the checkpoint's name", group.comm):
        token = group.comm.bcast(parts.new_token(state.step) if group.rank == 0 else None, root=0)
    span, residual = state.allreduce.residual(copy=False)  # written before anything changes it
    velocity = None if state.local_velocity is None else to_host(state.local_velocity)
    digest, problem = None, None
    try:
        digest = parts.write_part(path, token, group.rank, group.size, state.step, span, residual, velocity)
    except OSError as error:
        problem = f"cannot write rank {group.rank}'s part of the checkpoint {path}: {error}"
    with waiting.watched("Gather of the checkpoint's parts", group.comm, patient=True):  # each writes its part
        written = group.comm.gather((tuple(span), digest, velocity is not None, problem), root=0)
    if group.rank == 0:
        problem = next((p for *_, p in written if p), None)
        if problem is None:
            problem = _write_file(path, state, token, written)
        if problem:  # what this save wrote is of no use: its folder goes, the previous checkpoint stays
            parts.remove_save(path, token)
            problem = f"{problem}; the previous checkpoint, if any, is intact"
    # Patient: the others wait here while rank 0 writes (and nobody leaves before the checkpoint is complete).
    with waiting.watched(f"rank 0 saving the checkpoint {path}", group.comm, patient=group.rank != 0):
        raise_if_any(group.comm, problem, WriteError)


def _write_file(path: str, state: TrainState, token: str, written: List[tuple]) -> Optional[str]:
    """Rank 0's part of ``save_checkpoint``: the checkpoint file, renamed over
    the old one once whole, then the older saves' parts removed; the problem
    of a failed write, or None."""
    tmp = path + ".tmp"
    try:
        _write(tmp, state, token, written)
        os.replace(tmp, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        return f"cannot write the checkpoint {path}: {error}"
    parts.remove_other_saves(path, token)
    return None


def _write(tmp: str, state: TrainState, token: str, written: List[tuple]) -> None:
    """The checkpoint file at ``tmp``, stamped: the state every rank holds
    alike, and the manifest of the parts ``written`` (span, checksum, whether
    it holds a velocity: one entry per rank)."""
    from .distributed import to_host

    group, config, layout, shards = state.group, state.config, state.layout, state.shards
    shared = state.allreduce.shared_state()  # the same on every rank: rank 0's is saved
    os.makedirs(os.path.dirname(os.path.abspath(tmp)), exist_ok=True)
    with create_hdf5(tmp, in_memory=True) as f:
        f.attrs.update(
            format=FORMAT, version=__version__, step=state.step, world_size=group.size, config=config.to_json(),
            node_sizes=json.dumps(group.topology.node_sizes),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        )
        if state.pricing is not None:
            f.attrs["auto_priced"] = json.dumps(state.priced)
        for group_name, flat in (("params", state.params), ("optimizer/velocity", state.velocity)):
            host = to_host(flat)
            for name, (lo, hi) in layout.offsets.items():
                f.create_dataset(f"{group_name}/{name}", data=host[lo:hi].reshape(layout.shapes[name]))
        f["optimizer"].attrs.update(kind="sgd", momentum=config.momentum, weight_decay=config.weight_decay)
        spans, digests, velocities, _ = zip(*written)
        parts.manifest(f, token, list(spans), list(digests), list(velocities))
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
#: The option that lays the ranks out in nodes: what must match is the layout
#: it makes (``node_sizes``, saved since format 3), not the option's value
#: (--ranks-per-node 1 on hosts of one rank each lays out what no option does).
LAYOUT = frozenset({"ranks_per_node"})


@dataclass
class Saved:
    """What a rank needs from a checkpoint, read and checked before anything is restored."""

    config: TrainConfig
    step: int
    world_size: int
    params: np.ndarray
    velocity: np.ndarray
    parts: parts.Parts  # every saved rank's part: where it is, its span
    residual: Optional[np.ndarray]  # this rank's part, None on a rank the saving run did not have
    local_velocity: Optional[np.ndarray]  # ... its convergence aids' velocity, where the run had one
    schedule: Optional[dict] = None  # a stateful density schedule's state, where the run had one
    shared: Optional[np.ndarray] = None  # the allreducer's shared state (PowerSGD's Q), where it had one
    priced: Optional[dict] = None  # what algorithm="auto" priced, where the run used it
    node_sizes: Optional[list] = None  # the saving run's ranks per node (format 3)


def read_checkpoint(path: str, rank: int, layout: ParamLayout) -> Saved:
    """Read what ``rank`` restores on the world that saved ``path``: the
    checkpoint file, checked whole, and ``rank``'s own part; a bad file
    raises BadFileError. (A rank of another world reads other parts later.)"""
    with open_hdf5(path, unstamped=OLDER) as f:
        version = attribute(f, "format", int)
        if version not in READS:
            raise BadFileError(path, f"checkpoint format {version}; this version of spar_comm reads formats "
                                     f"{READS[0]} and {READS[1]}")
        names = [f"{group}/{name}" for group in GROUPS for name in layout.names]
        shared_names = ["schedule/accumulated", "allreducer/shared", *parts.MANIFEST]
        values = verify(f, keep=names + shared_names)
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
        index = (parts.read_manifest(f, path, world, layout.size, values) if version == 3
                 else _parts_within(f, path, world, layout.size))
        schedule = None
        if "schedule" in f:
            kept = f["schedule"]
            norm, density = attribute(kept, "previous_norm", float), attribute(kept, "density", float)
            if not (norm == -1 or norm >= 0) or not 0 < density <= 1:
                raise BadFileError(path, f"schedule: previous_norm {norm} and density {density} must be a norm "
                                         "(or -1: none yet) and a density in (0, 1]")
            accumulated = None
            if "schedule/accumulated" in f:
                dataset(f, "schedule/accumulated", "f", (layout.size,))
                accumulated = finite(path, "schedule/accumulated", values["schedule/accumulated"])
            schedule = dict(accumulated=accumulated, previous_norm=norm, density=density)
        shared = None
        if "allreducer/shared" in f:
            dataset(f, "allreducer/shared", "f", (None,))
            shared = finite(path, "allreducer/shared", values["allreducer/shared"])
        priced = _priced(path, attribute(f, "auto_priced", str)) if "auto_priced" in f.attrs else None
        node_sizes = _node_sizes(path, attribute(f, "node_sizes", str), world) if version == 3 else None
    residual, local = index.read(rank) if rank < world else (None, None)
    return Saved(config, step, world, *flats, index, residual, local, schedule, shared, priced, node_sizes)


def _parts_within(f: Any, path: str, world: int, size: int) -> parts.Parts:
    """Format 2's manifest: the parts are the file's own ``residuals/rank<r>``
    (checked as the file was verified)."""
    spans = []
    for r in range(world):
        ds = dataset(f, f"residuals/rank{r}", "f", (None,))
        lo, hi = attribute(ds, "lo", int), attribute(ds, "hi", int)
        if not 0 <= lo <= hi <= size or hi - lo != ds.shape[0]:
            raise BadFileError(path, f"residuals/rank{r} holds {ds.shape[0]} values for the range [{lo}, {hi}) "
                                     f"of {size}")
        spans.append((lo, hi))
    velocities = []
    for r in range(world):
        velocities.append(f"aids/velocity/rank{r}" in f)
        if velocities[-1]:
            dataset(f, f"aids/velocity/rank{r}", "f", (size,))
    return parts.Parts(path, None, tuple(spans), ("",) * world, tuple(velocities), size)


def _node_sizes(path: str, text: str, world: int) -> list:
    """The ``node_sizes`` attribute: ranks per node, summing to the world."""
    try:
        sizes = json.loads(text)
    except ValueError:
        sizes = None
    if not (isinstance(sizes, list) and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)
            and sum(sizes) == world):
        raise BadFileError(path, f"attribute 'node_sizes' is not the ranks per node of {world} ranks: {text!r:.60}")
    return sizes


def _priced(path: str, text: str) -> dict:
    """The ``auto_priced`` attribute, checked as ``auto.resumed`` will take it."""
    try:
        priced = json.loads(text)
        from_state(priced)
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
    on every rank, and nothing is changed. On the world that saved it, each
    rank restores its own part, to the bit. On another number of ranks or
    layout of nodes, the residuals and the aids' velocities are redistributed
    with their totals kept (``redistribute.py``), and rank 0 says so in one
    line. A run with momentum correction restores the convergence aids'
    velocity, which the checkpoint must then hold; so must it a stateful
    density schedule's state.
    """
    config, group, schedule, reducer = state.config, state.group, state.schedule, state.allreduce
    span, mine = reducer.residual(copy=False)
    span = tuple(span)
    with waiting.watched("Allgather of the residuals' spans", group.comm):
        spans = group.comm.allgather(span)
    layout_known = saved.node_sizes is not None  # format 3: the nodes themselves, not the option that made them
    same_world = (saved.world_size == group.size and tuple(spans) == saved.parts.spans
                  and (not layout_known or list(saved.node_sizes) == list(group.topology.node_sizes)))
    changed = config.differences(saved.config)
    if layout_known or not same_world:
        changed = {key: value for key, value in changed.items() if key not in LAYOUT}
    if changed:
        detail = ", ".join(f"{key}: {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items()))
        raise ConfigError(f"cannot resume {path}: settings differ from the checkpoint's ({detail})")
    if state.local_velocity is not None and not all(saved.parts.velocities):
        raise ConfigError(f"cannot resume {path}: it holds no local velocity for momentum correction")
    stateful = hasattr(schedule, "load_state_dict")
    if stateful and saved.schedule is None:
        raise ConfigError(f"cannot resume {path}: it holds no state for the density schedule")
    shared = reducer.shared_state()
    if (None if shared is None else shared.shape) != (None if saved.shared is None else saved.shared.shape):
        raise ConfigError(f"cannot resume {path}: the allreducer's shared state (PowerSGD's Q) does not fit this run")
    if same_world:
        residual, local = saved.residual, saved.local_velocity
    else:
        residual, local = _redistributed(saved, path, group, spans, mine.dtype,
                                         state.local_velocity is not None)
    restored = [(state.params, saved.params), (state.velocity, saved.velocity)]
    if state.local_velocity is not None:
        restored.append((state.local_velocity, local))
    xp = array_api_compat.array_namespace(state.params)
    for flat, host in restored:
        flat[...] = xp.asarray(host, dtype=flat.dtype, device=array_api_compat.device(flat))
    reducer.load_residual(span, residual)
    if saved.shared is not None:
        reducer.load_shared_state(saved.shared)
    if stateful:
        schedule.load_state_dict(saved.schedule, xp, like=state.params)
    state.step = saved.step


def _redistributed(saved: Saved, path: str, group: Group, spans: List[Tuple[int, int]], dtype: np.dtype,
                   velocity: bool) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """This rank's residual (and aids' velocity, where ``velocity``), in ``dtype``, on a world
    other than the saving one: the saved totals, redistributed. Collective; a
    bad part is refused on every rank alike, and a saved residual that no new
    rank covers (an algorithm that keeps none) is a ConfigError."""
    index, rank = saved.parts, group.rank
    with waiting.watched(f"reading the parts of the checkpoint {path}", group.comm, patient=True):
        def read() -> Tuple[np.ndarray, Optional[np.ndarray], List[Tuple[int, int]]]:
            cache: dict = {}  # one part at a time: a rank's reads cost its own state and one part

            def part(r: int) -> Tuple[np.ndarray, Optional[np.ndarray]]:
                if r not in cache:
                    cache.clear()
                    cache[r] = index.read(r)
                return cache[r]

            residual = redistribute.redistributed(rank, spans, index.spans, lambda r: part(r)[0], dtype)
            local = None
            if velocity:
                whole = [(0, index.size)] * group.size
                local = redistribute.redistributed(rank, whole, [(0, index.size)] * index.world,
                                                   lambda r: part(r)[1], dtype)
            lost = redistribute.lost(spans, index.size, index.spans, lambda r: part(r)[0], dtype) if rank == 0 else []
            return residual, local, lost

        residual, local, lost = agree(group.comm, read)
        lost = group.comm.bcast(lost, root=0)
    if lost:
        raise ConfigError(f"cannot resume {path} on {group.size} ranks: this run's allreducer keeps no residual "
                          f"where the saved ones hold values ({lost})")
    if rank == 0:
        was = f"{index.world} ranks" + (f" (nodes of {saved.node_sizes})" if saved.node_sizes else "")
        now = f"{group.size} ranks (nodes of {group.topology.node_sizes})"
        print(f"resuming {path}, saved by {was}, on {now}: the residuals redistributed with their total kept",
              flush=True)
    return residual, local
