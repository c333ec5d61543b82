"""The optimizer wrapper's buckets: which parameters, planned alike on every
rank, and where they may live.

Gradients are grouped into buckets of about ``bucket_cap_mb`` in reverse
registration order (the order in which backward produces them, as in DDP);
parameters named dense, and each dtype, fill buckets of their own. Every rank
must plan the same buckets, or their collectives would not match.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from mpi4py import MPI

from ..errors import ConfigError
from .broadcast import first_difference
from .streams import as_tensor, tensor_device

#: The dtypes the allreducers take.
DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def named_parameters(optimizer: torch.optim.Optimizer, named: Optional[Iterable]) -> Tuple[List, Optional[str]]:
    """The optimizer's parameters that take gradients, named, in registration order."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return [], f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
    ours = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    if named is None:
        return [(f"param.{i}", p) for i, p in enumerate(ours)], None
    named = list(named)
    names = [n for n, _ in named]
    if len(set(names)) != len(names):
        return [], "named_parameters has repeated names"
    by_id = {id(p): (n, p) for n, p in named}
    missing = [i for i, p in enumerate(ours) if id(p) not in by_id]
    if missing:
        return [], f"{len(missing)} of the optimizer's parameters are not in named_parameters"
    wanted = {id(p) for p in ours}
    return [(n, p) for n, p in named if id(p) in wanted], None


def settings_problem(named: List, dense: Sequence[Any], bucket_cap_mb: Any, passes: Any) -> Optional[str]:
    """Why the optimizer's own settings cannot make buckets, or None."""
    if not named:
        return "the optimizer has no parameters that take gradients"
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        return f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}"
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        return f"backward_passes_per_step must be an integer >= 1, got {passes!r}"
    names = {n for n, _ in named}
    unknown = [d for d in dense if isinstance(d, str) and d not in names]
    if unknown:
        return f"dense= names no parameter: {', '.join(map(repr, unknown))}"
    for name, p in named:
        if p.dtype not in DTYPES:
            return f"parameter {name!r} is {p.dtype}; the allreducers take float32, float64, float16 and bfloat16"
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        return f"the parameters are on several devices ({', '.join(devices)}): put the model on one"
    return None


def device_problem(named: List, memory: Any) -> Optional[str]:
    """Whether the parameters are where the topology's allreducers work: the
    rank's GPU for ``gpu``, the CPU for ``cpu`` and ``gpu-simulator``."""
    want = tensor_device(memory)
    for name, p in named:
        if p.device == want:
            continue
        if memory.name == "gpu" and p.device.type == "cuda":
            return (f"parameter {name!r} is on {p.device}, but this rank's GPU is {want} (its place on its host "
                    "modulo the device count): put the model there, model.to(spar_comm.torch.local_device())")
        if memory.name == "gpu":
            return f"parameter {name!r} is on {p.device}; a topology on the GPU takes parameters on {want}"
        if p.device.type == "cuda":
            return (f"parameter {name!r} is on {p.device}; a topology on {memory.name} takes CPU tensors "
                    "(CUDA parameters need Topology(device='gpu'), the default when no topology is given)")
        return f"parameter {name!r} is on {p.device}; a topology on {memory.name} takes CPU tensors"
    return None


def bucket_entries(named: List, dense: Sequence[Any], cap_mb: float) -> List[Tuple[str, List]]:
    """Buckets of at most about ``cap_mb`` each, filled in reverse registration
    order; parameters named in ``dense`` and each dtype fill buckets of their
    own, so one open bucket per (kind, dtype) at a time."""
    keep_dense = {d for d in dense if isinstance(d, str)} | {id(d) for d in dense if isinstance(d, torch.Tensor)}
    cap = cap_mb * 2**20
    closed: List[Tuple[str, List]] = []
    open_: Dict[Tuple[str, torch.dtype], List] = {}
    filled: Dict[Tuple[str, torch.dtype], int] = {}
    for name, p in reversed(named):
        key = ("dense" if name in keep_dense or id(p) in keep_dense else "sparse", p.dtype)
        open_.setdefault(key, []).append((name, p))
        filled[key] = filled.get(key, 0) + p.numel() * p.element_size()
        if filled[key] >= cap:
            closed.append((key[0], open_.pop(key)))
            del filled[key]
    closed += [(kind, entries) for (kind, _), entries in open_.items()]
    return closed


def signature(entries: Iterable[Tuple[str, torch.Tensor]]) -> List[Tuple[str, Tuple[int, ...], str]]:
    """What every rank's bucket must agree on: names, shapes and dtypes."""
    return [(name, tuple(p.shape), DTYPES[p.dtype]) for name, p in entries]


class FlatBucket:
    """Parameters reduced together: their names, the flat buffer where their
    allreducer reads them (the node's shared memory for hitopk and
    hier_dense; GPU memory on the GPU), and a view of it shaped as each."""

    def __init__(self, entries: List[Tuple[str, torch.Tensor]], reducer: Any):
        self.names = [name for name, _ in entries]
        self.params = [p for _, p in entries]
        self.reducer = reducer
        self.flat = as_tensor(reducer.buffer)
        self.views: List[torch.Tensor] = []
        start = 0
        for p in self.params:
            self.views.append(self.flat[start : start + p.numel()].view(p.shape))
            start += p.numel()

    def signature(self) -> List[Tuple[str, Tuple[int, ...], str]]:
        return signature(zip(self.names, self.params))


def require_same_buckets(comm: MPI.Comm, signature: List) -> None:
    """ConfigError on every rank unless every rank formed the same buckets."""
    everyone = comm.allgather(signature)  # pickled: once, at construction
    problems = [
        f"rank {r}: {first_difference(flat(theirs), flat(everyone[0]))}"
        for r, theirs in enumerate(everyone) if theirs != everyone[0]
    ]
    if problems:
        raise ConfigError("ranks formed different gradient buckets (the models differ): " + "; ".join(problems)
                          + " (compared with rank 0)")


def flat(signature: List) -> List:
    return [entry for bucket in signature for entry in bucket]
