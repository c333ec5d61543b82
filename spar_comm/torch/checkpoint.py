"""Saving and resuming a torch job through ``torch.distributed.checkpoint``,
on the world that saved it or on another one.

    state = {"model": app_state, "optimizer": opt, "hook": hook_state}
    sct.save_checkpoint(state, "ckpt", step)           # every rank, every N steps
    resumed = sct.load_checkpoint(state, "ckpt")       # every rank, at the start
    if resumed and rank == 0:
        print(resumed)

``state`` is what ``dcp.save`` and ``dcp.load`` take, with spar_comm's state
given as the objects themselves (a ``DistributedOptimizer``, the
``HookState`` of ``comm_hook``, the ``HSDPState`` of ``hsdp_hook``), which
DCP treats as ``Stateful``.

A save goes to a new folder of the directory, and rank 0 then commits it by
replacing the file ``latest`` that names it (written aside and renamed): a
save cut short (a kill, a full disk) leaves the previous save committed,
never a checkpoint that mixes two steps or lacks a rank's part (DCP's own
traps: TORCH-NOTES.md).

On the world that saved it the load is a plain ``dcp.load``: each rank takes
back its own residuals, to the bit. On another number of ranks no saved
residual fits a new rank as it is (a residual covers that rank's span of a
bucket, and the spans follow the world), so what is kept is their total, by
``spar_comm/redistribute.py``'s rule, as train.py's checkpoint does: at each
position the saved residuals that cover it are added in rank order (the
rounding of one sum), and the total goes to one new rank that covers it.
For the HSDP hook, a shard's replicas cover it: a resume takes another
number of nodes of as many ranks, never nodes of another size (FSDP's
shards, and so every residual's positions, follow the node's size).
The saved world is read from DCP's metadata (the ranks that the residuals'
keys name); every rank then loads every saved rank's residuals (for the hook
each is a whole model's worth, so a rank briefly holds the saved world's),
keeps its share, and the objects' own ``load_state_dict`` takes it as a
state of this world.

A plain ``dcp.load`` on another world is refused by those ``load_state_dict``
naming this module's ``load_checkpoint``, on every rank alike, when DCP gets
that far: on fewer ranks, and on more with ``allow_partial_load``. On more
ranks without it DCP itself stops first ("Missing key ... residuals.rank{r}"):
a rank's template names its own key, which the smaller world never saved.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..errors import ConfigError
from .. import redistribute, waiting
from ..consensus import raise_if_any
from .ddp import HookState
from .fsdp import HSDPState
from .optimizer import _DistributedOptimizer
from .state import (HOOK_STATE_FORMAT, HSDP_STATE_FORMAT, STATE_FORMAT, hook_residuals, hsdp_residuals,
                    optimizer_residuals, rank_key)
from .world import job_comm

#: The file naming a directory's committed save.
COMMITTED = "latest"


@dataclass(frozen=True)
class Resumed:
    """What ``load_checkpoint`` loaded: the checkpoint, the step its save was
    committed at (None for a checkpoint that ``dcp.save`` wrote by itself),
    and the number of ranks that saved it and that loaded it."""

    path: str
    step: Optional[int]
    saved_world: int
    world: int

    def __str__(self) -> str:
        at = "" if self.step is None else f" at step {self.step}"
        how = ("each rank's residuals to the bit" if self.saved_world == self.world
               else "the residuals redistributed with their total kept")
        return f"resumed {self.path}{at}, saved by {self.saved_world} ranks, on {self.world}: {how}"


def _dcp() -> Any:
    """torch.distributed.checkpoint, imported at first use: the import takes
    most of a second, in every process of a job that may never save."""
    import torch.distributed.checkpoint as dcp

    return dcp


def save_checkpoint(state: Mapping[str, Any], directory: str, step: int) -> str:
    """Save ``state`` (``dcp.save``'s argument) into a new folder of
    ``directory``, then commit it: rank 0 replaces ``directory/latest``, and
    removes the older saves. Collective over torch.distributed's default
    group. Returns the new save's path. Atomic: until the commit, the
    previous save is the one ``load_checkpoint`` finds. A rank waits for the
    others at most ``SPAR_COMM_TIMEOUT`` (spar_comm.waiting), as in every
    collective of spar_comm's: a peer that stops answering mid-save ends the
    job instead of hanging it for the group's own timeout."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    made = [None]
    if rank == 0:
        os.makedirs(directory, exist_ok=True)
        made[0] = tempfile.mkdtemp(prefix=f"step{step:09d}-", dir=directory)  # new: never a save over another
    with waiting.watched(f"saving the checkpoint in {directory}", job_comm(None, None)):
        if dist.is_initialized():
            dist.broadcast_object_list(made, src=0)
        path = made[0]
        dcp = _dcp()
        dcp.save(dict(state), storage_writer=dcp.FileSystemWriter(path, overwrite=False))
    if rank == 0:  # DCP's coordinator: its save returns once every rank's part and the metadata are written
        _commit(directory, {"save": os.path.basename(path), "step": int(step),
                            "world_size": dist.get_world_size() if dist.is_initialized() else 1})
        for name in os.listdir(directory):
            if name.startswith("step") and os.path.join(directory, name) != path:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    return path


def _commit(directory: str, pointer: Dict[str, Any]) -> None:
    """Replace ``directory/latest`` whole: written aside, flushed to disk, renamed over the old one."""
    fd, temporary = tempfile.mkstemp(prefix=f".{COMMITTED}-", dir=directory)
    with os.fdopen(fd, "w") as out:
        json.dump(pointer, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(temporary, os.path.join(directory, COMMITTED))
    folder = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def committed(path: str) -> Optional[Tuple[str, Optional[int]]]:
    """(the DCP checkpoint, its step) that ``path`` names: ``path`` itself
    when DCP's metadata is there, else the save that ``path/latest``
    commits; None when there is neither."""
    if os.path.exists(os.path.join(path, ".metadata")):
        return path, None
    try:
        with open(os.path.join(path, COMMITTED)) as text:
            pointer = json.load(text)
        return os.path.join(path, pointer["save"]), int(pointer["step"])
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ConfigError(f"{os.path.join(path, COMMITTED)} does not name a save: {error}") from error


def load_checkpoint(state: Dict[str, Any], path: str) -> Optional[Resumed]:
    """Load ``state`` (``dcp.load``'s argument, spar_comm's state as the
    objects) from ``path`` (a directory of ``save_checkpoint``'s saves, or a
    checkpoint ``dcp.save`` wrote), on this world whatever world saved it.
    None, with nothing loaded, when ``path`` holds no committed save.
    Collective. A ``DistributedOptimizer`` is given its wrapped optimizer's
    state first (``init_state()``), so DCP fills its momentum. A checkpoint
    that does not fit (another model, another bucket layout) raises
    ConfigError on every rank, naming it."""
    comm = job_comm(None, None)
    try:
        found, problem = committed(path), None
    except ConfigError as error:
        found, problem = None, str(error)
    raise_if_any(comm, problem)
    if any(comm.allgather(found is None)):
        raise_if_any(comm, None if found is None else (f"other ranks find no committed save in {path}: do all "
                                                       "ranks see one file system?"))
        return None
    checkpoint, step = found
    ours = {key: value for key, value in state.items()
            if isinstance(value, (_DistributedOptimizer, HookState, HSDPState))}
    for value in ours.values():
        if isinstance(value, _DistributedOptimizer):
            value.init_state()
    try:
        keys, problem = list(_dcp().FileSystemReader(checkpoint).read_metadata().state_dict_metadata), None
    except Exception as error:  # noqa: BLE001 (DCP's reader raises what the file system and pickle raise)
        keys, problem = [], f"cannot read the checkpoint {checkpoint}'s metadata: {error}"
    saved = None
    if problem is None:
        saved, problem = _saved_world(checkpoint, keys, ours)
    raise_if_any(comm, problem)
    saved = comm.size if saved is None else saved
    with waiting.watched(f"loading the checkpoint {checkpoint}", comm):  # as save_checkpoint's
        if saved == comm.size:
            _dcp().load(state, checkpoint_id=checkpoint)
        else:
            _load_on_another_world(state, checkpoint, saved, keys)
    return Resumed(checkpoint, step, saved, comm.size)


def _residual_keys(name: str, value: Any) -> "re.Pattern[str]":
    """The DCP key of a saved rank's residuals of entry ``name`` (one object a
    rank for the hook, one a bucket for the optimizer); group 1 is the rank."""
    if isinstance(value, (HookState, HSDPState)):
        return re.compile(rf"^{re.escape(name)}\.residuals\.rank(\d+)$")
    return re.compile(rf"^{re.escape(name)}\.spar_comm\.residuals\.rank(\d+)\.bucket\d+$")


def _saved_world(checkpoint: str, keys: List[str], ours: Mapping[str, Any]) -> Tuple[Optional[int], Optional[str]]:
    """The number of ranks that saved spar_comm's entries of ``checkpoint``
    (ranks 0 to n - 1 name keys of their residuals in DCP's metadata,
    ``keys``); None where there is no such entry. Or why it cannot be told."""
    worlds = set()
    for name, value in ours.items():
        pattern = _residual_keys(name, value)
        ranks = {int(match.group(1)) for match in map(pattern.match, keys) if match}
        if not ranks:
            return None, (f"the checkpoint {checkpoint} holds no rank's residuals of {name!r} as this version saves "
                          "them (a checkpoint of an older layout loads with a plain torch.distributed.checkpoint.load "
                          "on the world that saved it)")
        if ranks != set(range(len(ranks))):
            return None, f"the checkpoint {checkpoint} holds the residuals of {name!r} of ranks {sorted(ranks)}"
        worlds.add(len(ranks))
    if len(worlds) > 1:
        return None, f"the checkpoint {checkpoint}'s entries were saved by {sorted(worlds)} ranks"
    return (worlds.pop() if worlds else None), None


def _load_on_another_world(state: Dict[str, Any], checkpoint: str, saved: int, keys: List[str]) -> None:
    """Load into templates that ask for every saved rank's residuals, then
    hand each spar_comm object its share as a state of this world, and the
    rest as ``dcp.load`` would."""
    from torch.distributed.checkpoint.stateful import Stateful

    template = {}
    for key, value in state.items():
        if isinstance(value, HookState):
            template[key] = _hook_template(value, saved)
        elif isinstance(value, HSDPState):
            template[key] = _hsdp_template(saved)
        elif isinstance(value, _DistributedOptimizer):
            template[key] = _optimizer_template(value, key, saved, keys)
        else:
            template[key] = value.state_dict() if isinstance(value, Stateful) else value
    _dcp().load(template, checkpoint_id=checkpoint)
    for key, value in state.items():
        if isinstance(value, HookState):
            value.load_state_dict(_hook_share(value, template[key], saved))
        elif isinstance(value, HSDPState):
            value.load_state_dict(_hsdp_share(value, template[key], saved))
        elif isinstance(value, _DistributedOptimizer):
            value.load_state_dict(_optimizer_share(value, template[key], saved))
        elif isinstance(value, Stateful):
            value.load_state_dict(template[key])
        else:
            state[key] = template[key]


# -- the DDP hook's state: whole parameters per rank, by coordinate ----------------------------
def _hook_template(hook: HookState, saved: int) -> Dict[str, Any]:
    """Every saved rank's residuals, as whole objects (DCP loads a tuple into any template value)."""
    return {"format": HOOK_STATE_FORMAT, "world_size": saved, "algorithm": hook.algorithm,
            "residuals": {rank_key(r): () for r in range(saved)}}


def _hook_share(hook: HookState, loaded: Dict[str, Any], saved: int) -> Dict[str, Any]:
    """This rank's ``state_dict()`` on this world from every saved rank's
    residuals: each parameter's total, the positions ``i`` with ``i mod
    world == rank`` kept here (every rank covers every parameter)."""
    comm = hook._comm
    by_rank: List[Dict[Tuple[int, int], np.ndarray]] = []
    problem = None
    for r in range(saved):
        mine, problem = hook_residuals(loaded, r, saved)
        if problem is not None:
            break
        by_rank.append(mine)
    share: Dict[Tuple[int, int], np.ndarray] = {}
    if problem is None:
        for coordinate in sorted(set().union(*by_rank)):
            lengths = {len(r[coordinate]) for r in by_rank if coordinate in r}
            if len(lengths) > 1:
                problem = f"the saved ranks' residuals at {coordinate} have different lengths {sorted(lengths)}"
                break
            n = lengths.pop()
            spans = [(0, n) if coordinate in r else (0, 0) for r in by_rank]
            dtype = next(r[coordinate].dtype for r in by_rank if coordinate in r)
            share[coordinate] = redistribute.redistributed(comm.rank, [(0, n)] * comm.size, spans,
                                                           lambda r: by_rank[r][coordinate], dtype)
    raise_if_any(comm, problem)
    mine = tuple((b, p, torch.from_numpy(values)) for (b, p), values in sorted(share.items()))
    return {"format": HOOK_STATE_FORMAT, "world_size": comm.size, "algorithm": loaded.get("algorithm"),
            "residuals": {rank_key(comm.rank): mine}}


# -- the HSDP hook's state: each rank's shard of each FSDP module -------------------------------
def _hsdp_template(saved: int) -> Dict[str, Any]:
    """Every saved rank's residuals, as whole objects, and the saved mesh."""
    return {"format": HSDP_STATE_FORMAT, "world_size": saved, "mesh": [], "density": 0.0,
            "residuals": {rank_key(r): () for r in range(saved)}}


def _hsdp_share(hsdp: HSDPState, loaded: Dict[str, Any], saved: int) -> Dict[str, Any]:
    """This rank's ``state_dict()`` on this mesh from every saved rank's
    residuals, on nodes of as many ranks (so the same shards): for each
    module and shard, the saved replicas' residuals totalled, each
    position's total on one of this job's replicas of the shard (the ``i mod
    replicas``-th), as the DDP hook's coordinates are."""
    comm, replica = hsdp._comm, hsdp.topology.world
    by_rank: List[Dict[str, Any]] = []
    problem = None
    per_node = (list(loaded.get("mesh") or []) + [None, None])[1]
    if per_node != hsdp.mesh[1]:
        problem = (f"the HSDP state was saved on nodes of {per_node} ranks; this job's nodes have {hsdp.mesh[1]}: "
                   "FSDP shards each parameter over a node's ranks, so no saved residual covers a shard of this "
                   "job's; resume on nodes of as many ranks (the number of nodes may change)")
    for r in range(saved if problem is None else 0):
        mine, problem = hsdp_residuals(loaded, r, saved, None)
        if problem is not None:
            break
        by_rank.append(mine)
    share = []
    for name in sorted(set().union(*by_rank)) if problem is None else []:
        ours = [r[name][1:] for r in by_rank if name in r and r[name][0] == hsdp.shard]  # (span, values)
        if name not in hsdp._groups or len({span for span, _ in ours}) > 1:
            problem = f"the HSDP state's residuals of module {name!r} do not fit this model's shards"
            break
        if ours:
            (lo, hi), dtype = ours[0][0], ours[0][1].dtype
            values = redistribute.redistributed(replica.rank, [(lo, hi)] * replica.size, [span for span, _ in ours],
                                                lambda r: ours[r][1], dtype)
            share.append((name, hsdp.shard, lo, hi, torch.from_numpy(values)))
    raise_if_any(comm, problem)
    return dict(loaded, world_size=comm.size, mesh=list(hsdp.mesh), residuals={rank_key(comm.rank): tuple(share)})


# -- the optimizer's state: each rank's span of each bucket ---------------------------------------
def _optimizer_template(opt: _DistributedOptimizer, name: str, saved: int, keys: List[str]) -> Dict[str, Any]:
    """The optimizer's ``state_dict()`` asking for every saved rank's
    residuals (whole objects, as the hook's) in place of this rank's."""
    template = opt.state_dict()
    residuals: Dict[str, Dict[str, Any]] = {rank_key(r): {} for r in range(saved)}
    pattern = re.compile(rf"^{re.escape(name)}\.spar_comm\.residuals\.(rank\d+)\.(bucket\d+)$")
    for match in filter(None, map(pattern.match, keys)):
        residuals[match.group(1)][match.group(2)] = ()
    template["spar_comm"]["residuals"] = residuals
    return template


def _optimizer_share(opt: _DistributedOptimizer, loaded: Dict[str, Any], saved: int) -> Dict[str, Any]:
    """This rank's ``state_dict()`` on this world: for each bucket, the saved
    ranks' residuals totalled over the spans of this world's ranks, each
    position's total on one rank that covers it (``redistribute.py``)."""
    comm = opt._comm
    entry = loaded.get("spar_comm")
    signature = [b.signature() for b in opt.buckets]
    spans = comm.allgather([tuple(int(x) for x in b.reducer.residual_state(copy=False)[0]) for b in opt.buckets])
    problem, shares = None, {}
    by_rank = []
    for r in range(saved):
        parsed, problem = optimizer_residuals(entry, r, saved, signature)
        if problem is not None:
            break
        by_rank.append(parsed)
    for i, bucket in enumerate(opt.buckets if problem is None else []):
        saved_spans = [parsed[i][0] for parsed in by_rank]
        new_spans = [mine[i] for mine in spans]

        def read(r: int, i: int = i) -> np.ndarray:
            return by_rank[r][i][1]

        dtype = bucket.reducer.residual_state(copy=False)[1].dtype
        lost = redistribute.lost(new_spans, bucket.reducer.size, saved_spans, read, dtype)
        if lost:
            problem = (f"bucket {i}: this job's allreducer ({bucket.reducer.name}) keeps no residual at {lost}, "
                       "where the saved ones hold values")
            break
        shares[f"bucket{i}"] = (torch.tensor(new_spans[comm.rank], dtype=torch.int64),
                                torch.from_numpy(redistribute.redistributed(comm.rank, new_spans, saved_spans, read,
                                                                            dtype)))
    raise_if_any(comm, problem)
    # The allreducers here hold the new world's spans; the residuals were put in them.
    share = dict(entry, format=STATE_FORMAT, world_size=comm.size, residuals={rank_key(comm.rank): shares},
                 algorithms=[b.reducer.name for b in opt.buckets])
    return dict(loaded, spar_comm=share)
