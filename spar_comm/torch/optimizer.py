"""PyTorch: sparsified gradient allreduce inside your own training script.

    import spar_comm.torch as sct
    sct.broadcast_parameters(model)                  # rank 0's weights everywhere
    optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(), density=0.001)
    sct.broadcast_optimizer_state(optimizer)
    ...
    loss.backward()                                  # buckets reduced while it runs; returns with the mean
    optimizer.step()

Horovod's shape. Gradients are grouped into buckets (``buckets.py``), each
with its own allreducer, so ``algorithm="auto"`` chooses per bucket. A
bucket's allreduce starts on a communication thread once its last gradient
is accumulated (``register_post_accumulate_grad_hook``) while backward goes
on; the engine (``engine.py``) does the rest. On the CPU with torch on one
thread the gradients are copied into the bucket and checked for NaN and Inf
in one pass, so the allreducer makes no check pass of its own. Each
``.grad`` then becomes a view of its bucket's result (DDP's
``gradient_as_bucket_view``), valid until the next step reduces that bucket.
As in DDP, ``backward()`` returns only once the buckets it started are
reduced, so ``GradScaler`` and clipping read the mean, alike on every rank.

Parameters on the rank's GPU make buckets and allreducers on the GPU: the
gradients never leave it but through the allreducer's staging or a
CUDA-aware MPI, ordered by CUDA events (``streams.py``).
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .. import kernels, waiting
from ..collectives import Allreducer
from ..consensus import raise_if_any, require_same
from ..errors import ConfigError
from ..topology import Topology
from . import buckets
from .backward_end import EndOfBackward
from .comm_thread import CommThread
from .engine import Engine, EngineOwner, InOrder, Reduction, reduction_of
from .state import (STATE_FORMAT, bucket_residual_entries, choice_problem, optimizer_residuals, rank_key,
                    stateful_problem)
from .streams import NoStreams, as_array, streams_for
from .world import job_comm, require_job_world

__all__ = ["DistributedOptimizer"]

#: A problem bit agreed over ranks at every synchronize.
_TOO_MANY_PASSES = 1


@dataclass(frozen=True)
class Plan:
    """The optimizer wrapper's own settings: how gradients are bucketed
    (``bucket_cap_mb``, the names or tensors kept ``dense``), how many
    backward passes a step accumulates, and whether buckets reduce while
    backward runs (``overlap``)."""

    bucket_cap_mb: float = 25
    backward_passes_per_step: int = 1
    dense: Tuple[Any, ...] = ()
    overlap: bool = True

    def problem(self, named: List) -> Optional[str]:
        return buckets.settings_problem(named, self.dense, self.bucket_cap_mb, self.backward_passes_per_step)

    def to_dict(self) -> Dict[str, Any]:
        """As plain data (a tensor in ``dense`` by its shape)."""
        dense = [d if isinstance(d, str) else f"tensor{tuple(d.shape)}" for d in self.dense]
        return {"bucket_cap_mb": self.bucket_cap_mb, "backward_passes_per_step": self.backward_passes_per_step,
                "dense": dense, "overlap": self.overlap}


class _ParameterBucket(buckets.FlatBucket):
    """Parameters reduced together (``FlatBucket``), and how many of their
    gradients are final for this step."""

    def __init__(self, index: int, entries: List[Tuple[str, torch.nn.Parameter]], reducer: Allreducer):
        super().__init__(entries, reducer)
        self.index = index
        self.passes = [0] * len(self.params)
        self.waiting = len(self.params)
        self.ready = False
        self.done = False  # reduced (or refused) this step
        self.times: Dict[str, float] = {}
        self.produced: List[Any] = []  # events after which the gradients are final
        self.finished: Any = None  # event after which ``.grad`` holds the result

    def reset(self) -> None:
        self.passes = [0] * len(self.params)
        self.waiting = len(self.params)
        self.ready = False
        self.done = False
        self.times = {}
        self.produced = []
        self.finished = None

    def reduce(self, streams: NoStreams, engine: Engine) -> None:
        """Gather the gradients, allreduce in place, and make each ``.grad``
        a view of its result (as DDP's ``gradient_as_bucket_view``): on the
        communication stream, once the gradients' producers are done. A
        gradient that is still its view (``zero_grad(set_to_none=False)``,
        accumulation) is in the buffer already and is not copied."""
        self.times["start"] = time.perf_counter()
        self.done = True
        with streams.communicating(self.produced):
            engine.reduce(self.reducer, self.flat, self.reducer.buffer, finite=self.gather())
            for view, p in zip(self.views, self.params):
                p.grad = view
            self.finished = streams.finished()
        self.times["end"] = time.perf_counter()

    def gather(self) -> Optional[bool]:
        """Copy each gradient into its view of the buffer, and say whether they
        hold no NaN or Inf where the copies found out: the check rides on the
        copy's pass, and the allreducer makes none of its own. That takes
        host tensors alike in dtype and layout, and torch on one thread (a
        copy on one thread is no match for torch's copy on several plus a
        check). None where any gradient went unread (already its view) or
        went by torch's copy: the allreducer checks."""
        checked, finite = True, True
        fused = self.reducer.memory.in_host_memory and torch.get_num_threads() == 1
        for view, p in zip(self.views, self.params):
            grad = p.grad.detach()
            if grad.data_ptr() == view.data_ptr():
                checked = False
            elif fused and grad.device.type == "cpu" and grad.is_contiguous() and grad.dtype == view.dtype:
                finite &= kernels.copy_all_finite(as_array(view), as_array(grad))
            else:
                view.copy_(grad)
                checked = False
        return False if not finite else (True if checked else None)


class _DistributedOptimizer(EngineOwner):
    """Mixed into the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    def _spar_setup(self, named: List[Tuple[str, torch.nn.Parameter]], reduction: Reduction,
                    topology: Topology, plan: "Plan", grad_scaler: Any) -> None:
        self.topology = topology
        self.reduction, self.plan = reduction, plan
        self._engine = Engine(reduction, topology.world, grad_scaler)
        self._streams = streams_for(topology.memory)
        self.buckets: List[_ParameterBucket] = [
            _ParameterBucket(index, entries, reducer)
            for index, (entries, reducer) in enumerate(self._engine.make_buckets(topology, named, plan.dense,
                                                                                 plan.bucket_cap_mb))
        ]
        self._comm = topology.world.Dup()  # this class's own small collectives, never mixed with the allreducers'
        self._flags = np.zeros(1, dtype=np.int32)
        self._problems = 0
        self._order = InOrder()  # its ``next``: the lowest bucket index not yet started this step
        self._in_flight = False
        self._reduced = False  # synchronize() ran, and no gradient has been accumulated since
        self._skip = False
        self._backward_end = EndOfBackward(self._backward_ended)
        self.last_wait = 0.0  # seconds the last synchronize() waited
        self.last_timings: List[Dict[str, float]] = []  # bucket_timings() of the last synchronized step
        self._done = threading.Event()
        self._thread = CommThread("spar_comm-allreduce", self._run) if plan.overlap else None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(bucket, i))
            for bucket in self.buckets for i, p in enumerate(bucket.params)
        ]

    @property
    def grad_scaler(self) -> Any:
        return self._engine.grad_scaler

    # -- backward ------------------------------------------------------------------------
    def _hook(self, bucket: _ParameterBucket, i: int):
        def on_grad_accumulated(_: torch.Tensor) -> None:
            self._reduced = False
            bucket.passes[i] += 1
            if bucket.passes[i] > self.plan.backward_passes_per_step:
                self._problems |= _TOO_MANY_PASSES  # agreed and raised at synchronize()
            elif bucket.passes[i] == self.plan.backward_passes_per_step:
                event = self._streams.produced()
                if event is not None:
                    bucket.produced.append(event)
                bucket.waiting -= 1
                if bucket.waiting == 0:
                    self._mark_ready(bucket)

        return on_grad_accumulated

    def _mark_ready(self, bucket: _ParameterBucket) -> None:
        """Start every ready bucket whose predecessors have all started: the
        same order on every rank, whatever order backward produced them in."""
        bucket.ready = True
        bucket.times["ready"] = time.perf_counter()
        self._backward_end.arm()
        for ready in self._order.arrived(bucket.index, bucket):
            self._start(ready)

    def _start(self, bucket: _ParameterBucket) -> None:
        self._in_flight = True
        if self._thread is not None:
            self._thread.put(bucket)

    def _backward_ended(self) -> None:
        """Finish the buckets started in this backward before it returns, as
        DDP does, so that whatever reads ``.grad`` before ``step()``
        (``GradScaler``'s overflow check, clipping) sees the mean, alike on
        every rank, and never races the communication thread. Buckets that
        backward did not make ready wait for ``synchronize()``."""
        started = self.buckets[: self._order.next]
        if self._thread is None:
            for bucket in started:
                if not bucket.done:
                    self._run(bucket)
        else:
            ended = threading.Event()
            self._thread.put(ended)
            ended.wait()
        for bucket in started:
            self._streams.consume(bucket.finished)

    # -- the communication thread --------------------------------------------------------
    def _run(self, job: Any) -> None:
        """A bucket; an event to set once the buckets before it are done; or
        None: the end of the step (agree on local problems)."""
        if isinstance(job, threading.Event):
            job.set()
        elif job is None:
            with self._engine.job("spar_comm.torch end of step", agreed=False):
                self._flags[0] = self._problems
                waiting.collective(self._comm, "Allreduce", MPI.IN_PLACE, self._flags, op=MPI.BOR)
                self._done.set()
        else:
            with self._engine.job(f"spar_comm.torch bucket {job.index} allreduce"):
                if job.index == 0:  # the step's first bucket: none is being reduced
                    self._engine.begin_step([bucket.reducer for bucket in self.buckets])
                job.reduce(self._streams, self._engine)

    # -- the public interface ------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every bucket is reduced and its ``.grad`` holds the mean.
        Buckets whose gradients backward never produced (unused parameters, or
        no backward at all) are reduced now, with zeros for missing ``.grad``."""
        for bucket in self.buckets[self._order.next :]:
            if bucket.ready:  # waiting for a bucket before it
                continue
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            event = self._streams.produced()
            if event is not None:
                bucket.produced.append(event)
            bucket.ready = True
        started = time.perf_counter()
        while self._order.next < len(self.buckets):  # all ready now: each arrival releases the next ones
            for ready in self._order.arrived(self._order.next, self.buckets[self._order.next]):
                self._start(ready)
        if self._thread is None:
            for bucket in self.buckets:
                if not bucket.done:
                    self._run(bucket)
            self._run(None)
        else:
            self._thread.put(None)
            self._done.wait()
        self.last_wait = time.perf_counter() - started
        self._done.clear()
        for bucket in self.buckets:
            self._streams.consume(bucket.finished)
        problems = int(self._flags[0])
        self._problems, self._in_flight = 0, False
        self._order.restart()
        self._reduced = True
        self.last_timings = self.bucket_timings()
        for bucket in self.buckets:
            bucket.reset()
        errors = self._engine.end_step()  # every residual as it was where a bucket overflowed: the step is skipped
        if problems & _TOO_MANY_PASSES:
            raise ConfigError(
                f"a rank ran more than backward_passes_per_step={self.plan.backward_passes_per_step} backward "
                "passes before step(); the gradients of this step were not applied"
            )
        if errors:
            raise errors[0]

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside this block does not synchronize: for code that called
        ``synchronize()`` itself to work on the reduced gradients (clipping)."""
        self._skip = True
        try:
            yield
        finally:
            self._skip = False

    #: ``torch.amp.GradScaler.step`` hands this step its scale and overflow
    #: verdict instead of unscaling, and calls it even on an overflow, so that
    #: every rank passes the step's end together (``step`` below).
    _step_supports_amp_scaling = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize``), then step. Under
        ``GradScaler``: skip the update where its verdict found an overflow (the
        same on every rank: it read the reduced gradients), else unscale them
        first, as GradScaler would have."""
        if not self._skip:
            if self._reduced:  # as Horovod warns
                warnings.warn("step() after synchronize() with no backward between reduces the gradients again "
                              "(their mean, as if it were a gradient): call step() inside "
                              "`with optimizer.skip_synchronize():`", stacklevel=2)
            self.synchronize()
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found_inf is None:
            return super().step(closure)
        if self.grad_scaler is None and any(b.reducer.keeps_residual for b in self.buckets):
            raise ConfigError("DistributedOptimizer under GradScaler with error feedback needs "
                              "grad_scaler=<the scaler>, so that the residuals follow its scale")
        if self._steps_amp_itself:  # the wrapped optimizer unscales and skips itself (fused Adam)
            return super().step(closure)
        if float(found_inf) > 0:
            return None
        if grad_scale is not None:  # GradScaler left the unscaling to this step
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            torch._foreach_mul_(grads, grad_scale.double().reciprocal().float())
        handed = {name: self.__dict__.pop(name) for name in ("grad_scale", "found_inf")}
        try:  # the wrapped optimizer must not see them (GradScaler deletes them after the step)
            return super().step(closure)
        finally:
            self.__dict__.update(handed)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._refuse_in_flight("zero_grad()")
        super().zero_grad(set_to_none)

    def bucket_timings(self) -> List[Dict[str, float]]:
        """``perf_counter`` times of the last step's buckets: ``ready`` (its last
        gradient accumulated; absent if synchronize started it), ``start`` and
        ``end`` of its allreduce, for the step in flight; ``synchronize()``
        (and so ``step()``) keeps them as ``last_timings`` and starts afresh."""
        return [dict(b.times) for b in self.buckets]

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state plus this rank's error-feedback residual
        per bucket (in the gradients' own units, whatever the loss scale), under
        ``["spar_comm"]["residuals"]["rank{r}"]["bucket{i}"]`` as a tuple of
        ``span`` and ``values`` tensors, beside the world size, the bucket layout and the
        algorithms. Local: no rank's state reaches another. Each rank loads its
        own: ``torch.distributed.checkpoint.save``/``load`` of every rank's
        ``state_dict()`` (its keys name the rank, so no rank's residual is
        taken for another's), or ``torch.save`` of each rank's to a file of its
        own."""
        self._refuse_in_flight("state_dict()")
        state = super().state_dict()
        mine = bucket_residual_entries([bucket.reducer for bucket in self.buckets], self._engine.scale)
        state["spar_comm"] = {
            "format": STATE_FORMAT,
            "world_size": self._comm.size,
            "settings": {**self.reduction.to_dict(), **self.plan.to_dict()},
            "buckets": [b.signature() for b in self.buckets],
            "algorithms": [b.reducer.name for b in self.buckets],
            "values": [b.reducer.settings.values for b in self.buckets],
            "stateful_parameters": len(state["state"]),  # the wrapped optimizer's, to check a load against
            "residuals": {rank_key(self._comm.rank): mine},
        }
        return state

    def init_state(self) -> None:
        """Give the wrapped optimizer the state its first step would create
        (momentum, moments) where it has none, with a step of learning rate 0
        on zero gradients: no parameter moves, nothing is communicated and no
        residual changes. For ``torch.distributed.checkpoint.load``, which
        fills only the entries its template (``state_dict()``) already holds:
        call it before taking the template from a fresh optimizer. Local."""
        self._refuse_in_flight("init_state()")
        if self.state:
            return
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        grads = [p.grad for p in params]
        rates = [group["lr"] for group in self.param_groups]
        try:
            for p in params:
                p.grad = torch.zeros_like(p)
            for group in self.param_groups:
                group["lr"] = torch.zeros_like(group["lr"]) if isinstance(group["lr"], torch.Tensor) else 0.0
            super().step()  # the wrapped optimizer's own step: no synchronize
        finally:
            for group, rate in zip(self.param_groups, rates):
                group["lr"] = rate
            for p, grad in zip(params, grads):
                p.grad = grad

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restore what this rank's ``state_dict()`` returned, in a job of the
        same world size and bucket layout. Collective: a state that holds
        another rank's residuals (one rank's saved state loaded by every rank),
        or any mismatch on any rank, raises ConfigError naming it on every
        rank, before anything is loaded."""
        self._refuse_in_flight("load_state_dict()")
        saved = state_dict.get("spar_comm") if isinstance(state_dict, dict) else None
        mine, problem = optimizer_residuals(saved, self._comm.rank, self._comm.size,
                                            [b.signature() for b in self.buckets])
        if problem is None:
            problem = choice_problem(saved, [b.reducer for b in self.buckets], self.reduction.algorithm,
                                     self.reduction.allreducer.values)
        if problem is None:
            problem = stateful_problem(saved, state_dict.get("state"))
        raise_if_any(self._comm, problem)
        try:
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "spar_comm"})
            problem = None
        except (ValueError, KeyError, TypeError) as error:
            problem = f"the wrapped optimizer refused its state: {error}"
        raise_if_any(self._comm, problem)
        for bucket, (span, values) in zip(self.buckets, mine):
            bucket.reducer.load_residual_state(span, np.asarray(values) * self._engine.scale)

    def _refuse_in_flight(self, what: str) -> None:
        if self._in_flight:
            raise RuntimeError(f"{what} while gradient allreduces are in flight: call step() or synchronize() first")


def DistributedOptimizer(  # noqa: N802 (a factory that reads like the class it makes, as in Horovod)
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
    *,
    algorithm: str = "hitopk",
    density: float = 0.001,
    selector: str = "mstopk",
    topology: Optional[Topology] = None,
    bucket_cap_mb: float = 25,
    backward_passes_per_step: int = 1,
    dense: Sequence[Any] = (),
    overlap: bool = True,
    error_feedback: bool = True,
    non_finite: str = "propagate",
    grad_scaler: Any = None,
    process_group: Any = None,
    transport: Optional[str] = None,
    values: Optional[str] = None,
    indices: Optional[str] = None,
    **options: Any,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` applies the mean of every rank's
    gradient, reduced by ``algorithm`` in buckets that overlap backward.

    Args:
        optimizer: any ``torch.optim.Optimizer``.
        named_parameters: names, in registration order (default ``param.<i>``).
        algorithm, density, selector, values, indices, error_feedback: as for
            ``spar_comm.make_allreducer``; ``options`` too (``max_density``,
            ``powersgd``'s ``rank``). Set ``optimizer.density`` between steps,
            up to ``max_density``, alike on every rank.
        topology: the ranks; default: ``process_group`` (torch's default group)
            when torch.distributed is initialised, else MPI's world
            (``transport="mpi"`` keeps MPI).
        bucket_cap_mb: about how much a bucket holds.
        backward_passes_per_step: backward passes accumulated locally per step.
        dense: names (or tensors) never sparsified: embeddings, norms, heads.
            Their buckets take the ``values`` codec alone.
        overlap: reduce buckets while backward runs (else as it ends).
        non_finite: ``"propagate"``: a NaN or Inf on any rank makes the mean NaN
            on every rank, residuals unchanged (``GradScaler`` skips the step
            everywhere); ``"raise"``: NonFiniteGradientError from ``step()``.
        grad_scaler: the ``torch.amp.GradScaler`` in use, so that the residuals
            follow its scale.

    Returns:
        An instance of the optimizer's own class (LR schedulers accept it),
        sharing its parameter groups and state: use it from now on.
        ``backward()`` returns with every ``.grad`` the mean, as under DDP.

    Raises:
        ConfigError: on every rank, for bad or disagreeing settings or models,
            or ranks that are not the torch job's (``world.py``).

    Example:
        >>> opt = DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        ...                            algorithm="hitopk", density=0.01)
        >>> loss.backward(); opt.step()

    Collective: every rank calls it with the same model.
    """
    comm = topology.world if topology is not None else job_comm(process_group, transport)
    require_job_world(comm, "spar_comm.torch.DistributedOptimizer")
    reduction = reduction_of(algorithm, non_finite, options, density=density, selector=selector,
                             error_feedback=error_feedback, shared_buffer=True, values=values, indices=indices)
    plan = Plan(bucket_cap_mb, backward_passes_per_step, tuple(dense), overlap)
    named, problem = buckets.named_parameters(optimizer, named_parameters)
    problem = problem or reduction.problem() or plan.problem(named)
    raise_if_any(comm, problem)
    require_same(comm, "DistributedOptimizer settings", {**reduction.agreed(), **plan.to_dict()})
    if topology is None:
        topology = Topology(comm, device="gpu" if named[0][1].device.type == "cuda" else "cpu")
    raise_if_any(topology.world, buckets.device_problem(named, topology.memory))
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param_groups, state and hooks
    wrapped._steps_amp_itself = bool(getattr(type(optimizer), "_step_supports_amp_scaling", False))
    wrapped._spar_setup(named, reduction, topology, plan, grad_scaler)
    return wrapped
