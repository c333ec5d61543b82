"""The optimizer's and the DDP hook's state dicts: their formats, and the
readers that take this rank's residuals from one, or say why not.

Each rank's ``state_dict()`` holds its own residuals only, under a key that
names the rank (``residuals["rank{r}"]``): ``torch.distributed.checkpoint``
keeps one copy of a key saved with different values on different ranks, so a
residual under a key every rank uses would come back as one rank's. A state
that holds another rank's residuals (one rank's ``torch.save`` loaded by
every rank) is refused on every rank, naming the ways that scale.
"""
from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from .broadcast import first_difference
from .buckets import flat

#: Named wherever a state holding another rank's residuals is refused.
SCALABLE_WAYS = (
    "each rank must load its own residuals: save and load every rank's state with "
    "torch.distributed.checkpoint.save(state, checkpoint_id=...) and torch.distributed.checkpoint.load(state, "
    "checkpoint_id=...) on every rank (state holding this rank's state_dict()), or torch.save each rank's own "
    "state_dict() to a file per rank and load that rank's file"
)

#: Named wherever a state saved on another number of ranks is refused.
OTHER_WORLD = ("spar_comm.torch.load_checkpoint(state, path) loads a checkpoint on another number of ranks, "
               "the residuals' total kept")


#: ``DistributedOptimizer.state_dict()["spar_comm"]["format"]``: this rank's
#: residuals only, ``residuals["rank{r}"]["bucket{i}"]`` a ``(span, values)``
#: tuple of tensors, which torch.distributed.checkpoint saves whole, as one
#: object, so that a template of another world (other spans) asks for no
#: tensor of another size.
STATE_FORMAT = 3
#: ``HookState.state_dict()["format"]``: this rank's residuals only,
#: ``residuals["rank{r}"]`` a tuple of (bucket, position, values).
HOOK_STATE_FORMAT = 2
#: ``HSDPState.state_dict()["format"]``: this rank's residuals only,
#: ``residuals["rank{r}"]`` a tuple of (FSDP module's name, shard, lo, hi,
#: values), one a module: its span of the module's flat shard, the shard
#: being the rank's place in its node's FSDP mesh (which a resume on
#: another number of nodes totals the replicas' residuals by).
HSDP_STATE_FORMAT = 2
#: A module's residual in an HSDP state: (shard, (lo, hi), values).
HSDPResidual = Tuple[int, Tuple[int, int], np.ndarray]
#: A parameter's coordinate under the DDP hook: (bucket index, position) in the process's first iteration.
Coordinate = Tuple[int, int]


def rank_key(rank: int) -> str:
    """The key of rank ``rank``'s residuals in ``state_dict()["residuals"]``."""
    return f"rank{rank}"


def own_residuals(residuals: Any, rank: int, world_size: int, what: str) -> Tuple[Any, Optional[str]]:
    """This rank's entry of a state's ``residuals`` (a mapping by ``rank_key``),
    or why there is none. The reason is the same on every rank given the same
    wrong state, so that ``raise_if_any`` names it once."""
    if not isinstance(residuals, Mapping):
        return None, f"{what}'s residuals are not a mapping by rank ('rank0', 'rank1', ...)"
    mine = residuals.get(rank_key(rank))
    if mine is not None:
        return mine, None
    others = sorted(str(key) for key in residuals)
    if not others:
        return None, f"{what} holds no rank's residuals"
    return None, (f"{what} holds the residuals of {', '.join(others)} of a job of {world_size} ranks, not this "
                  f"rank's: {SCALABLE_WAYS}")


def format_problem(saved: Any, fmt: int, world_size: int, what: str, made_by: str,
                   other_world: str = OTHER_WORLD) -> Optional[str]:
    """Why ``saved`` is no state of format ``fmt`` saved on ``world_size``
    ranks, or None. A format that no release reads is refused by name;
    ``other_world`` says what to do with a state of another world size."""
    if not isinstance(saved, Mapping) or "format" not in saved:
        return f"{what} has no spar_comm entry of format {fmt} (was it saved by {made_by}?)"
    if saved["format"] != fmt:
        return (f"{what} is of format {saved['format']!r}, which this version does not read: it reads format {fmt} "
                f"(saved by {made_by})")
    if saved.get("world_size") != world_size:
        return f"{what} was saved by {saved.get('world_size')} ranks; this job has {world_size}: {other_world}"
    return None


def optimizer_residuals(saved: Any, rank: int, world_size: int, signature: List) -> Tuple[List, Optional[str]]:
    """This rank's residuals, ``((lo, hi), values)`` a bucket, from a saved
    ``spar_comm`` entry of ``DistributedOptimizer.state_dict()``, or why they
    cannot be loaded."""
    problem = format_problem(saved, STATE_FORMAT, world_size, "the state_dict",
                             "a DistributedOptimizer's state_dict()")
    if problem is not None:
        return [], problem
    return bucket_residuals(saved, rank, world_size, signature, "the state_dict")


def bucket_residual_entries(reducers: List[Any], scale: float) -> Dict[str, Tuple[torch.Tensor, torch.Tensor]]:
    """This rank's residual of each bucket, ``bucket{i}`` -> a ``(span, values)``
    tuple of tensors in the gradients' own units (``scale``: the loss scale
    the residuals are in), as ``bucket_residuals`` reads them."""
    mine = {}
    for i, reducer in enumerate(reducers):
        span, values = reducer.residual_state(copy=False)  # the division below makes the copy
        mine[f"bucket{i}"] = (torch.tensor([int(span[0]), int(span[1])], dtype=torch.int64),
                              torch.from_numpy(values / scale))
    return mine


def bucket_residuals(saved: Mapping[str, Any], rank: int, world_size: int, signature: List,
                     what: str) -> Tuple[List, Optional[str]]:
    """This rank's residuals, ``((lo, hi), values)`` a bucket, from a saved
    state of buckets (its ``buckets`` signature and ``residuals`` by rank, as
    ``bucket_residual_entries`` wrote them), or why they cannot be loaded."""
    theirs = [[tuple((n, tuple(s), d)) for n, s, d in bucket] for bucket in saved.get("buckets", [])]
    if theirs != [[tuple(e) for e in bucket] for bucket in signature]:
        if len(theirs) != len(signature):
            return [], f"{what} has {len(theirs)} buckets; this one has {len(signature)}"
        return [], f"{what}'s buckets differ: {first_difference(flat(signature), flat(theirs))}"
    buckets, problem = own_residuals(saved.get("residuals"), rank, world_size, what)
    if problem is not None:
        return [], problem
    if not isinstance(buckets, dict) or sorted(buckets) != sorted(f"bucket{i}" for i in range(len(signature))):
        return [], f"{what}'s residuals of this rank are not {len(signature)} buckets (bucket0, ...)"
    out = []
    for i in range(len(signature)):
        try:
            span, values = buckets[f"bucket{i}"]
            lo, hi = (int(x) for x in (span.tolist() if isinstance(span, torch.Tensor) else span))
            ok = isinstance(values, torch.Tensor) and values.dim() == 1 and len(values) == hi - lo
            ok = ok and bool(torch.isfinite(values).all())
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return [], f"{what}'s residual of this rank, bucket {i}, is not finite values for its span"
        out.append(((lo, hi), values.detach().cpu().numpy()))
    return out, None


def hook_residuals(state: Any, rank: int, world_size: int) -> Tuple[Dict[Coordinate, np.ndarray], Optional[str]]:
    """This rank's residuals by coordinate from a ``HookState.state_dict()``, or why not."""
    problem = format_problem(state, HOOK_STATE_FORMAT, world_size, "the hook state",
                             "spar_comm.torch.comm_hook's state.state_dict()")
    if problem is not None:
        return {}, problem
    entries, problem = own_residuals(state.get("residuals"), rank, world_size, "the hook state")
    if problem is not None:
        return {}, problem
    mine: Dict[Coordinate, np.ndarray] = {}
    for entry in entries if isinstance(entries, (tuple, list)) else [None]:
        try:
            bucket, position, values = entry
            coordinate = (int(bucket), int(position))
            array = np.array(torch.as_tensor(values).detach().cpu().numpy()).ravel()
            ok = coordinate not in mine and bool(np.isfinite(array).all())
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return {}, ("the hook state's residuals of this rank are not (bucket, position, finite values), "
                        "one a parameter")
        mine[coordinate] = array
    return mine, None


def stateful_problem(saved: Dict[str, Any], state: Any) -> Optional[str]:
    """Whether the wrapped optimizer's state lost entries on the way: a
    ``torch.distributed.checkpoint.load`` into a fresh optimizer's
    ``state_dict()`` fills only what that template holds, and a torch
    optimizer holds no state before its first step."""
    had = saved.get("stateful_parameters")
    has = len(state) if isinstance(state, dict) else 0
    if not isinstance(had, int) or has >= had:
        return None
    return (f"the wrapped optimizer's state holds {has} parameters' entries where the saved one held {had}: "
            "torch.distributed.checkpoint.load fills only the entries of its template, and a fresh optimizer has "
            "none before its first step; call optimizer.init_state() before taking the template "
            "(optimizer.state_dict())")


def choice_problem(state: Any, reducers: List[Any], algorithm: str, values: Any) -> Optional[str]:
    """Under ``algorithm="auto"`` or ``values="auto"``: other allreducers or
    codecs than the saved job's cannot take its residuals as they are (a
    dense bucket keeps one through a lossy codec alone), nor go on to the
    same bits. A state saved before the choices were kept is taken as before."""
    chosen = (("algorithm", "algorithms", [r.name for r in reducers], algorithm),
              ("values", "values", [r.settings.values for r in reducers], values))
    for setting, key, mine, given in chosen:
        saved = state.get(key) if given == "auto" else None
        if saved is None:
            continue
        if not isinstance(saved, list) or len(saved) != len(mine) or \
                not all(a is None or isinstance(a, str) for a in saved):
            return f"the state_dict's {key} are not {len(mine)} entries, one a bucket"
        if saved != mine:
            return (f"{setting}='auto' chose {mine} for the buckets here and {saved} in the saved job (it prices "
                    "the link between nodes as it times it at the start): give both jobs the same figures with "
                    f"SPAR_COMM_CALIBRATION, or name the {setting} the saved job chose")
    return None


def hsdp_residuals(state: Any, rank: int, world_size: int, mesh: Optional[Tuple[int, int]]
                   ) -> Tuple[Dict[str, HSDPResidual], Optional[str]]:
    """Rank ``rank``'s residuals by FSDP module from an
    ``HSDPState.state_dict()`` saved on ``world_size`` ranks and, where
    given, on ``mesh`` (``(replicas, ranks a node)``), or why not."""
    problem = format_problem(state, HSDP_STATE_FORMAT, world_size, "the HSDP state",
                             "spar_comm.torch.hsdp_hook's state.state_dict()")
    if problem is None and mesh is not None and tuple(state.get("mesh", ())) != tuple(mesh):
        problem = (f"the HSDP state was saved on {state.get('mesh')} (replicas, ranks a node); this job's mesh is "
                   f"{tuple(mesh)}: each rank's residual covers its own shard")
    if problem is not None:
        return {}, problem
    entries, problem = own_residuals(state.get("residuals"), rank, world_size, "the HSDP state")
    if problem is not None:
        return {}, problem
    mine: Dict[str, HSDPResidual] = {}
    for entry in entries if isinstance(entries, (tuple, list)) else [None]:
        try:
            name, shard, lo, hi, values = entry
            array = np.array(torch.as_tensor(values).detach().cpu().numpy()).ravel()
            ok = isinstance(name, str) and name not in mine and array.size == int(hi) - int(lo)
            ok = ok and bool(np.isfinite(array).all())
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return {}, ("the HSDP state's residuals of this rank are not (module, shard, lo, hi, finite values), one "
                        "a module")
        mine[name] = (int(shard), (int(lo), int(hi)), array)
    return mine, None
