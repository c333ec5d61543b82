"""The modes drivers/bench_peers.py runs against each other, the settings
of a run, and the parts of a mode that do not depend on the run: what a
step times, what the communication's phases are, how a failure is told, and
a mode's time to a held-out target. torch is imported only by the functions
that use it."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import waiting
from ..collectives import ALGORITHMS

if TYPE_CHECKING:
    import torch

POWERSGD_RANKS = (1, 4)
#: torch's own modes, each run in a process of its own.
PEERS = ("ddp", "ddp_fp16", *(f"ddp_powersgd_r{r}" for r in POWERSGD_RANKS))
#: spar_comm's modes through DistributedOptimizer: (algorithm, values, indices).
SPAR = {**{f"spar_{a}": (a, None, None) for a in (*ALGORITHMS, "auto")},
        "spar_dense_float16": ("dense", "float16", None), "spar_dense_int8": ("dense", "int8", None),
        "spar_hitopk_int8": ("hitopk", "int8", "auto"), "spar_hitopk_spin": ("hitopk", None, None),
        "spar_auto_codecs": ("auto", "auto", "auto")}
#: spar_comm's modes whose waits spin in MPI (see ``spar_comm/waiting.py``).
SPINNING = ("spar_hitopk_spin",)
#: spar_comm's modes again over torch.distributed's gloo group (the torch
#: transport) instead of MPI: the same allreducers, on the same nodes.
OVER_TORCH = tuple(f"{mode}_torch" for mode in ("spar_dense", "spar_hier_dense", "spar_topka", "spar_hitopk",
                                                "spar_auto", "spar_hook"))
#: Sharded models (FSDP2) over torch.distributed's group, each as (what it
#: shards on, spar_comm's algorithm and value codec between nodes or None):
#: over the job, torch's HSDP, HSDP with spar_comm between nodes, and each
#: node alone with nothing between nodes (their floor).
SHARDED = {"fsdp": ("world", None), "hsdp": ("nodes", None), "hsdp_spar_topka": ("node", ("topka", None)),
           "hsdp_spar_topka_int8": ("node", ("topka", "int8")), "fsdp_per_node": ("node", None)}
#: Local steps (spar_comm.torch.OuterLoop: an outer step every --sync-every
#: steps, around the workload's own optimizer), each as (algorithm, value
#: codec, outer lr, outer momentum, overlapped): DiLoCo's Nesterov on the
#: dense pseudo-gradient in float32 or int8, and the sparse outer loop, error
#: feedback alone as SparseLoCo, with hitopk; ``_overlap``: the reduction
#: runs beside the next ``overlap_steps`` inner steps, its mean taken after them.
OUTER = {"diloco": ("dense", None, 0.7, 0.9, False), "diloco_int8": ("dense", "int8", 0.7, 0.9, False),
         "diloco_int8_overlap": ("dense", "int8", 0.7, 0.9, True),
         "local_hitopk": ("hitopk", None, 1.0, 0.0, False), "local_hitopk_int8": ("hitopk", "int8", 1.0, 0.0, False),
         "local_hitopk_int8_overlap": ("hitopk", "int8", 1.0, 0.0, True)}
MODES = (*PEERS, *SPAR, "spar_hook", *OVER_TORCH, *SHARDED, *OUTER, "no_comm")
#: The modes a job that torchrun launched runs: no MPI, and no peer forked
#: from a process whose gloo group already runs threads.
UNDER_TORCHRUN = (*OVER_TORCH, *SHARDED, "no_comm")


#: Where the communication of a spar_comm step went, in seconds summed over its buckets.
PHASES = ("select", "intra", "inter", "local", "copies", "wait")


@dataclass(frozen=True)
class PeerSettings:
    """How a run measures its modes: which, spar_comm's settings (density,
    selector, parameters reduced densely below ``dense_below`` elements),
    the buckets (PowerSGD's DDP given one for the whole model where
    ``powersgd_one_bucket``), the emulated nodes, the rounds, the seed of
    PowerSGD's projections, held-out evaluations every ``eval_every`` rounds
    and their ``targets``, how long a peer may stay silent, the peer made
    to fail (``inject_failure``), and the local-step modes' period
    (``sync_every``), density (``outer_density``, default ``density``) and,
    for the ``_overlap`` ones, the inner steps the reduction runs beside
    (``overlap_steps``)."""

    modes: Sequence[str]
    density: float
    selector: str
    dense_below: Optional[int]
    bucket_cap_mb: float
    powersgd_one_bucket: bool
    ranks_per_node: Optional[int]
    warmup: int
    repeat: int
    seed: int
    eval_every: Optional[int]
    targets: Sequence[float]
    peer_timeout: float
    inject_failure: Optional[str]
    sync_every: int = 8
    outer_density: Optional[float] = None
    overlap_steps: int = 1


def over_mpi(mode: str) -> str:
    """The mode that runs ``mode``'s allreducers over MPI (itself, where it does)."""
    return mode[: -len("_torch")] if mode in OVER_TORCH else mode


def describe(error: BaseException) -> str:
    """An error in one short line, as a failed mode reports it on every rank."""
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"[:300]


@dataclass
class Workload:
    """What every mode trains alike. ``metric`` is None where nothing is held out."""

    new_model: Callable[[], "torch.nn.Module"]  # every new model starts from the same weights
    next_batch: Callable[[], Tuple["torch.Tensor", ...]]
    loss: Callable[["torch.nn.Module", tuple], "torch.Tensor"]
    new_optimizer: Callable[[Iterable], "torch.optim.Optimizer"]
    metric: Optional[Callable[["torch.nn.Module"], float]] = None
    metric_name: str = ""
    lower_is_better: bool = False

    def reached(self, value: float, target: float) -> bool:
        return value <= target if self.lower_is_better else value >= target


def classify(model: "torch.nn.Module", batch: Tuple["torch.Tensor", "torch.Tensor"]) -> "torch.Tensor":
    """The cross-entropy of ``model`` on a batch of (inputs, classes)."""
    import torch.nn.functional as F

    return F.cross_entropy(model(batch[0]), batch[1])


def held_out(score: Callable[["torch.nn.Module"], float]) -> Callable[["torch.nn.Module"], float]:
    """``score`` of a model in eval mode without gradients; DDP's wrapper is
    looked through, since its forward would broadcast buffers to ranks that
    do not evaluate."""
    def metric(model: "torch.nn.Module") -> float:
        import torch

        module = getattr(model, "module", model)
        module.eval()
        with torch.no_grad():
            value = score(module)
        module.train()
        return value
    return metric


class Runner:
    """One mode: its replica of the model, its optimizer, what a step sends
    between nodes, its note (or what makes it at the end), and (spar_comm's
    optimizer) where its communication went. A ``collective`` mode's
    evaluation runs on every rank (a sharded model's forward gathers its
    parameters), the others' on rank 0 alone."""

    def __init__(self, model: Any, optimizer: Any, sent: Callable[[], Optional[float]],
                 note: Union[str, Callable[[], str]] = "", phases: Optional[Callable[[], Dict[str, float]]] = None,
                 spin: bool = False, collective: bool = False):
        self.model, self.optimizer, self.sent, self.phases = model, optimizer, sent, phases
        self._note, self.spin, self.collective = note, spin, collective

    @property
    def note(self) -> str:
        return self._note() if callable(self._note) else self._note

    def step(self, batch: Any, loss: Callable) -> float:
        """One training step; its seconds."""
        with waiting.sleeping(waiting.SLEEP and not self.spin):  # the communication thread works only inside a step
            start = time.perf_counter()
            self.optimizer.zero_grad()
            loss(self.model, batch).backward()
            self.optimizer.step()
            return time.perf_counter() - start

    def evaluate(self, metric: Callable[[Any], float]) -> float:
        return metric(self.model)


def phases_of(opt: Any) -> Dict[str, float]:
    """This rank's last step of a spar_comm DistributedOptimizer ``opt``:
    inside the allreducers, selection, MPI inside and between nodes, and
    their own passes over memory (residual adds, scatter-adds, codecs, the
    check); around them, the copies of the gradients into the buckets; and
    how long step() waited after backward for the buckets still being reduced."""
    figures = dict.fromkeys(PHASES, 0.0)
    for bucket, times in zip(opt.buckets, opt.last_timings):
        last = bucket.reducer.last
        figures["select"] += last["t_select"]
        figures["intra"] += last["t_intra"]
        figures["inter"] += last["t_inter"]
        figures["local"] += last["t_total"] - last["t_select"] - last["t_intra"] - last["t_inter"]
        figures["copies"] += times["end"] - times["start"] - last["t_total"]
    figures["wait"] = opt.last_wait
    return figures


def learning_curve(evaluations: List[Tuple[int, float]], elapsed: np.ndarray, work: Workload,
                   targets: List[float]) -> dict:
    """A mode's held-out metric against its own training time (``elapsed``:
    the slowest rank's steps, summed; evaluations not counted), and for each
    target the first evaluation that reached it."""
    curve = [[r, float(elapsed[r - 1]), value] for r, value in evaluations]

    def first(target: float) -> dict:
        reached = [point for point in curve if work.reached(point[2], target)]
        return dict(target=target, steps=reached[0][0] if reached else None,
                    seconds=reached[0][1] if reached else None)

    return dict(metric=work.metric_name, curve=curve, final_metric=curve[-1][2] if curve else None,
                to_target=[first(target) for target in targets])
