"""PyTorch: sparsified gradient allreduce inside your own training script.

    import spar_comm.torch as sct
    sct.broadcast_parameters(model)                  # rank 0's weights everywhere
    optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(), density=0.001)
    sct.broadcast_optimizer_state(optimizer)
    ...
    loss.backward()                                  # buckets reduced while it runs; returns with the mean
    optimizer.step()

Horovod's shape. Gradients are grouped into buckets of about ``bucket_cap_mb``
in reverse registration order (the order in which backward produces them, as
in DDP), each bucket with its own allreducer, so ``algorithm="auto"`` chooses
per bucket. A bucket's allreduce starts on a communication thread as soon as
its last gradient has been accumulated (``register_post_accumulate_grad_hook``)
while backward goes on. On the CPU with torch on one thread, its gradients
are copied into it and checked for NaN and Inf in the same pass, so the
allreducer makes no check pass of its own. Buckets start in index order on
every rank whatever order their gradients arrive in, so the collectives of
all ranks match. Each parameter's ``.grad`` then becomes a view of its
bucket's result (DDP's ``gradient_as_bucket_view``), valid until the next
step reduces that bucket.
As in DDP, ``backward()`` returns only once the buckets it started are
reduced (an autograd callback at its end), so ``GradScaler`` and gradient clipping read
the mean, the same on every rank. A NaN or Inf on any rank makes the mean NaN
on every rank (``GradScaler`` then skips the step everywhere), with the
residuals as they were.

Parameters on the rank's GPU (``cuda:i``, i its place on its host modulo the
device count) make buckets and allreducers on the GPU (``Topology(device=
"gpu")`` unless a topology is given): the gradients never leave the device
except through the allreducer's staging or a CUDA-aware MPI. Ordering is by
CUDA events (``streams.py``): each gradient hook records one on the stream
that produced the gradient, the bucket's communication waits for them on a
stream of its own, and ``synchronize()`` makes the caller's stream wait for
the communication. Under ``Topology(device="gpu-simulator")`` the same code
runs on CPU tensors with those operations doing nothing.
"""
from __future__ import annotations

import contextlib
import threading
import time
import warnings
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .. import kernels, waiting
from ..collectives import AUTO
from ..costmodel import auto
from ..consensus import raise_if_any
from ..device import device_index
from ..errors import ConfigError, NonFiniteGradientError, SparCommError
from ..launch import abort_job
from ..topology import Topology
from .backward_end import EndOfBackward
from .comm_thread import CommThread
from .state import OTHER_WORLD, agree, own_residuals, rank_key
from .streams import NoStreams, as_array, as_tensor, streams_for, tensor_device
from .world import check_size, job_comm, launched, require_job_world

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "broadcast_parameters", "local_device", "rank",
           "size"]

#: The dtypes the allreducers take.
_DTYPES = {torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16"}
#: ``state_dict()["spar_comm"]["format"]``: bumped when the layout of the entry changes.
#: 3: this rank's residuals only, under ``residuals["rank{r}"]["bucket{i}"]`` as a ``(span, values)``
#: tuple of tensors, which torch.distributed.checkpoint saves whole, as one object, so that a template
#: of another world (other spans) asks for no tensor of another size. 2 (still loaded): a ``{"span",
#: "values"}`` dict of tensors; 1 (still loaded): every rank's, a list by rank.
STATE_FORMAT = 3
#: A problem bit agreed over ranks at every synchronize.
_TOO_MANY_PASSES = 1
#: What a NaN or Inf in any rank's gradient does: a non-finite mean on every
#: rank (torch's convention, which GradScaler relies on), or NonFiniteGradientError.
NON_FINITE = ("propagate", "raise")


def non_finite_problem(value: Any) -> Optional[str]:
    """Why ``value`` is no ``non_finite`` setting, or None."""
    if value in NON_FINITE:
        return None
    return f"non_finite must be one of {', '.join(map(repr, NON_FINITE))}, got {value!r}"


class _Bucket:
    """Parameters reduced together: their flat buffer, its allreducer, and
    how many of their gradients are final for this step."""

    def __init__(self, index: int, entries: List[Tuple[str, torch.nn.Parameter]], reducer: Any):
        self.index = index
        self.names = [name for name, _ in entries]
        self.params = [p for _, p in entries]
        self.reducer = reducer
        # Assembled where the allreducer reads it (the node's shared memory for
        # hitopk/hier_dense; GPU memory on the GPU).
        self.flat = as_tensor(reducer.buffer)
        self.views: List[torch.Tensor] = []
        start = 0
        for p in self.params:
            self.views.append(self.flat[start : start + p.numel()].view(p.shape))
            start += p.numel()
        self.passes = [0] * len(self.params)
        self.waiting = len(self.params)
        self.ready = False
        self.done = False  # reduced (or refused) this step
        self.overflowed = False  # a rank's gradient held NaN or Inf this step
        self.kept: Any = None  # the residual as this step found it, where a step may be skipped
        self.times: Dict[str, float] = {}
        self.produced: List[Any] = []  # events after which the gradients are final
        self.finished: Any = None  # event after which ``.grad`` holds the result

    def signature(self) -> List[Tuple[str, Tuple[int, ...], str]]:
        return _signature(zip(self.names, self.params))

    def reset(self) -> None:
        self.passes = [0] * len(self.params)
        self.waiting = len(self.params)
        self.ready = False
        self.done = False
        self.overflowed = False
        self.kept = None
        self.times = {}
        self.produced = []
        self.finished = None

    def restore(self) -> None:
        """Put back the residual ``reduce`` kept: the step is skipped."""
        if self.kept is not None:
            self.reducer.feedback.residual[...] = self.kept

    def reduce(self, streams: NoStreams, non_finite: str, keep: bool, density: float) -> None:
        """Gather the gradients, allreduce in place, and make each ``.grad``
        a view of its result (as DDP's ``gradient_as_bucket_view``): on the
        communication stream, once the gradients' producers are done. A
        gradient that is still its view (``zero_grad(set_to_none=False)``,
        accumulation) is in the buffer already and is not copied. A NaN or
        Inf on any rank leaves the allreducer as it was and, unless
        ``non_finite="raise"``, makes the result NaN on every rank. ``keep``
        copies the residual first, for ``restore``. ``density``: the step's
        (a sparse allreducer's; a dense one has none)."""
        self.times["start"] = time.perf_counter()
        self.done = True
        with streams.communicating(self.produced):
            finite = self.gather()
            if keep:
                self.kept = self.reducer.feedback.residual.copy()
            try:
                self.reducer.allreduce(self.reducer.buffer, out=self.reducer.buffer,
                                       density=density if self.reducer.sparse else None, finite=finite)
            except NonFiniteGradientError:  # raised on every rank alike
                self.overflowed = True
                if non_finite == "raise":
                    raise
                self.flat.fill_(float("nan"))
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


class _DistributedOptimizer:
    """Mixed into the wrapped optimizer's own class (see ``DistributedOptimizer``)."""

    def _spar_setup(self, named: List[Tuple[str, torch.nn.Parameter]], algorithm: str, density: float,
                    selector: str, topology: Optional[Topology], bucket_cap_mb: float,
                    backward_passes_per_step: int, dense: Sequence[Any], overlap: bool,
                    error_feedback: bool, non_finite: str, grad_scaler: Any, values: Optional[str],
                    indices: Optional[str], options: Dict[str, Any]) -> None:
        self.topology = topology
        self.density = density  # the sparse buckets' next step's: settable between steps, up to max_density
        self._step_density = density  # the step's, read as its first bucket starts
        self.non_finite = non_finite
        self.grad_scaler = grad_scaler
        self._scale = 1.0  # the loss scale the residuals are in units of
        self._streams = streams_for(topology.memory)
        self._auto = algorithm == AUTO
        #: What ``algorithm="auto"`` priced, once for every bucket (None otherwise).
        self.pricing: Optional[auto.Pricing] = auto.price(topology) if self._auto else None
        world = self.topology.world
        self.backward_passes_per_step = backward_passes_per_step
        planned = _bucket_entries(named, dense, bucket_cap_mb)
        _require_same_buckets(world, [_signature(entries) for _, entries in planned])
        self.buckets: List[_Bucket] = []
        for index, (kind, entries) in enumerate(planned):
            if kind == "dense":  # never sparsified: only the values' codec applies
                name, settings = "dense", {"values": values}
            else:
                name, settings = algorithm, {"values": values, "indices": indices, **options}
                if name == "powersgd":
                    settings["shapes"] = [tuple(p.shape) for _, p in entries]  # the layers' matrices
            reducer = auto.make_allreducer(
                name, self.topology, sum(p.numel() for _, p in entries), _DTYPES[entries[0][1].dtype], density,
                selector, pricing=self.pricing, error_feedback=error_feedback, shared_buffer=True, **settings,
            )
            self.buckets.append(_Bucket(index, entries, reducer))
        self._comm = world.Dup()  # this class's own small collectives, never mixed with the allreducers'
        self._flags = np.zeros(1, dtype=np.int32)
        self._problems = 0
        self._next = 0  # the lowest bucket index not yet started this step
        self._in_flight = False
        self._reduced = False  # synchronize() ran, and no gradient has been accumulated since
        self._skip = False
        self._backward_end = EndOfBackward(self._backward_ended)
        self.last_wait = 0.0  # seconds the last synchronize() waited
        self.last_timings: List[Dict[str, float]] = []  # bucket_timings() of the last synchronized step
        self._errors: List[BaseException] = []
        self._done = threading.Event()
        self._thread = CommThread("spar_comm-allreduce", self._run) if overlap else None
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._hook(bucket, i))
            for bucket in self.buckets for i, p in enumerate(bucket.params)
        ]

    # -- backward ------------------------------------------------------------------------
    def _hook(self, bucket: _Bucket, i: int):
        def on_grad_accumulated(_: torch.Tensor) -> None:
            self._reduced = False
            bucket.passes[i] += 1
            if bucket.passes[i] > self.backward_passes_per_step:
                self._problems |= _TOO_MANY_PASSES  # agreed and raised at synchronize()
            elif bucket.passes[i] == self.backward_passes_per_step:
                event = self._streams.produced()
                if event is not None:
                    bucket.produced.append(event)
                bucket.waiting -= 1
                if bucket.waiting == 0:
                    self._mark_ready(bucket)

        return on_grad_accumulated

    def _mark_ready(self, bucket: _Bucket) -> None:
        """Start every ready bucket whose predecessors have all started: the
        same order on every rank, whatever order backward produced them in."""
        bucket.ready = True
        bucket.times["ready"] = time.perf_counter()
        self._backward_end.arm()
        while self._next < len(self.buckets) and self.buckets[self._next].ready:
            self._start(self.buckets[self._next])
            self._next += 1

    def _start(self, bucket: _Bucket) -> None:
        self._in_flight = True
        if self._thread is not None:
            self._thread.put(bucket)

    def _backward_ended(self) -> None:
        """Finish the buckets started in this backward before it returns, as
        DDP does, so that whatever reads ``.grad`` before ``step()``
        (``GradScaler``'s overflow check, clipping) sees the mean, alike on
        every rank, and never races the communication thread. Buckets that
        backward did not make ready wait for ``synchronize()``."""
        if self._thread is None:
            for bucket in self.buckets[: self._next]:
                if not bucket.done:
                    self._run(bucket)
        else:
            ended = threading.Event()
            self._thread.put(ended)
            ended.wait()
        for bucket in self.buckets[: self._next]:
            self._streams.consume(bucket.finished)

    # -- the communication thread --------------------------------------------------------
    def _run(self, job: Any) -> None:
        """A bucket; an event to set once the buckets before it are done; or
        None: the end of the step (agree on local problems)."""
        try:
            if isinstance(job, threading.Event):
                job.set()
                return
            if job is None:
                self._flags[0] = self._problems
                waiting.collective(self._comm, "Allreduce", MPI.IN_PLACE, self._flags, op=MPI.BOR)
                self._done.set()
                return
            try:
                if job.index == 0:  # the step's first bucket: none is being reduced
                    self._follow_scale()
                    self._step_density = self.density
                # A step that may be skipped keeps what it found, so that a skip leaves every residual as it was.
                job.reduce(self._streams, self.non_finite, self.grad_scaler is not None or self.non_finite == "raise",
                           self._step_density)
            except SparCommError as error:  # raised on every rank alike by the allreducer
                self._errors.append(error)
        except BaseException:
            # Not agreed between ranks (a bug, memory): the others would wait for ever.
            abort_job(self.topology.world, f"spar_comm.torch bucket {getattr(job, 'index', '')} allreduce")

    def _follow_scale(self) -> None:
        """Keep the residuals in the units of this step's gradients, scaled by
        ``grad_scaler``'s current scale (which changes by powers of two)."""
        if self.grad_scaler is None:
            return
        scale = float(self.grad_scaler.get_scale())
        if scale != self._scale:
            for bucket in self.buckets:
                bucket.reducer.feedback.rescale(scale / self._scale)
            self._scale = scale

    # -- the public interface ------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait until every bucket is reduced and its ``.grad`` holds the mean.
        Buckets whose gradients backward never produced (unused parameters, or
        no backward at all) are reduced now, with zeros for missing ``.grad``."""
        for bucket in self.buckets[self._next :]:
            for p in bucket.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            event = self._streams.produced()
            if event is not None:
                bucket.produced.append(event)
            bucket.ready = True
        started = time.perf_counter()
        while self._next < len(self.buckets):
            self._start(self.buckets[self._next])
            self._next += 1
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
        errors, problems = self._errors, int(self._flags[0])
        self._errors, self._problems, self._next, self._in_flight = [], 0, 0, False
        self._reduced = True
        self.last_timings = self.bucket_timings()
        if any(bucket.overflowed for bucket in self.buckets):  # on every rank alike: the step will be skipped
            for bucket in self.buckets:
                bucket.restore()
        for bucket in self.buckets:
            bucket.reset()
        if problems & _TOO_MANY_PASSES:
            raise ConfigError(
                f"a rank ran more than backward_passes_per_step={self.backward_passes_per_step} backward "
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
        mine = {}
        for i, bucket in enumerate(self.buckets):
            span, values = bucket.reducer.residual_state(copy=False)  # the division below makes the copy
            mine[f"bucket{i}"] = (torch.tensor([int(span[0]), int(span[1])], dtype=torch.int64),
                                  torch.from_numpy(values / self._scale))
        state["spar_comm"] = {
            "format": STATE_FORMAT,
            "world_size": self._comm.size,
            "buckets": [b.signature() for b in self.buckets],
            "algorithms": [b.reducer.name for b in self.buckets],
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
        same world size and bucket layout; a state of format 1 (every rank's
        residuals) gives this rank its own. Collective: a state that holds
        another rank's residuals (one rank's saved state loaded by every rank),
        or any mismatch on any rank, raises ConfigError naming it on every
        rank, before anything is loaded."""
        self._refuse_in_flight("load_state_dict()")
        saved = state_dict.get("spar_comm") if isinstance(state_dict, dict) else None
        mine, problem = _own_state(saved, self._comm.rank, self._comm.size, [b.signature() for b in self.buckets])
        if problem is None and self._auto:
            problem = _choice_problem(saved.get("algorithms"), [b.reducer.name for b in self.buckets])
        if problem is None:
            problem = _stateful_problem(saved, state_dict.get("state"))
        agree(self._comm, problem)
        try:
            super().load_state_dict({k: v for k, v in state_dict.items() if k != "spar_comm"})
            problem = None
        except (ValueError, KeyError, TypeError) as error:
            problem = f"the wrapped optimizer refused its state: {error}"
        raise_if_any(self._comm, problem)
        for bucket, (span, values) in zip(self.buckets, mine):
            bucket.reducer.load_residual_state(span, np.asarray(values) * self._scale)

    def _refuse_in_flight(self, what: str) -> None:
        if self._in_flight:
            raise RuntimeError(f"{what} while gradient allreduces are in flight: call step() or synchronize() first")


def rank() -> int:
    """This process's rank among the ranks spar_comm.torch works over
    (``world.job_comm``): for a sampler, or to print once. ConfigError where
    they are not the torch job's."""
    comm = job_comm()
    check_size(comm, "spar_comm.torch.rank()")
    return comm.rank


def size() -> int:
    """The number of ranks spar_comm.torch works over (``world.job_comm``);
    ConfigError where they are not the torch job's."""
    comm = job_comm()
    check_size(comm, "spar_comm.torch.size()")
    return comm.size


def local_device() -> torch.device:
    """This rank's GPU as the GPU path picks it (its place among the ranks of
    its host, modulo the device count), or the CPU when CUDA is not available.
    ConfigError on every rank unless the ranks spar_comm.torch works over
    (``world.job_comm``) are the job's.

    The place is torchrun's ``LOCAL_RANK`` where torchrun launched the job
    (``WORLD_SIZE`` set too; no collective: an NCCL group cannot gather
    before each rank has set its device, which is what this answer is for),
    else found collectively over MPI's world where that holds the job's
    ranks (``mpiexec``), else over the group, which then must be able to
    gather (gloo, or NCCL once each rank has set its device)."""
    comm = job_comm()
    told = launched()
    if told is not None and told.local_index is not None:  # every rank sees the same sizes
        check_size(comm, "spar_comm.torch.local_device()")
        return torch.device("cuda", device_index(told.local_index, torch.cuda.device_count())) \
            if torch.cuda.is_available() else torch.device("cpu")
    ranks = MPI.COMM_WORLD if MPI.COMM_WORLD.size == comm.size else comm
    require_job_world(ranks, "spar_comm.torch.local_device()")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    host = ranks.Split_type(MPI.COMM_TYPE_SHARED, key=ranks.rank)
    index = device_index(host.rank, torch.cuda.device_count())
    host.Free()
    return torch.device("cuda", index)


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

    Collective: every rank calls it with the same model. It works over
    ``topology``'s ranks when given, else over ``process_group`` (default:
    torch's default group) when torch.distributed is initialised, else over
    MPI's world; ``transport="mpi"`` keeps MPI (``world.job_comm``). ``named_parameters``
    names the parameters (default ``param.<i>`` in the optimizer's order) and
    its order is the registration order. ``dense`` lists names (or the
    parameters themselves) never to sparsify: embeddings, norms, heads.
    ``backward_passes_per_step=N`` accumulates N backward passes locally before
    one allreduce. ``overlap=False`` reduces every bucket as backward ends
    instead of while it runs. Either way ``backward()`` returns with the mean
    gradients, as in DDP. A NaN or Inf in any rank's gradient makes a bucket's
    mean NaN on every rank, residuals unchanged, so that ``GradScaler`` skips
    the step alike everywhere; ``non_finite="raise"`` raises
    NonFiniteGradientError from ``step()`` on every rank instead. Under ``torch.amp.GradScaler`` with error feedback,
    pass the scaler as ``grad_scaler``: the residuals then follow its scale
    (else a residual kept at one scale is added to gradients of another).
    ``values`` and ``indices`` are the codecs of the messages, and ``options``
    the algorithm's own settings (``powersgd``'s ``rank``), as for
    ``make_allreducer``; the ``dense`` buckets take ``values`` only.
    ``max_density=`` (an option of ``make_allreducer``) lets the density
    change between steps with nothing rebuilt: set ``optimizer.density``, as
    a schedule sets a learning rate, at most ``max_density``, alike on every
    rank (else ``step()`` raises ConfigError on every rank).
    The returned object is an instance of the optimizer's own class (so LR
    schedulers accept it) sharing its parameter groups and state; use it
    instead of ``optimizer`` from now on. Bad or disagreeing settings, or an
    MPI world that is not the torch job's (``world.py``), raise ConfigError on
    every rank.
    """
    comm = topology.world if topology is not None else job_comm(process_group, transport)
    require_job_world(comm, "spar_comm.torch.DistributedOptimizer")
    named, problem = _named_parameters(optimizer, named_parameters)
    if problem is None:
        problem = _settings_problem(named, dense, bucket_cap_mb, backward_passes_per_step, non_finite)
    raise_if_any(comm, problem)
    if topology is None:
        topology = Topology(comm, device="gpu" if named[0][1].device.type == "cuda" else "cpu")
    raise_if_any(topology.world, _device_problem(named, topology.memory))
    cls = type(type(optimizer).__name__, (_DistributedOptimizer, type(optimizer)), {})
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(optimizer.__dict__)  # the same param_groups, state and hooks
    wrapped._steps_amp_itself = bool(getattr(type(optimizer), "_step_supports_amp_scaling", False))
    wrapped._spar_setup(named, algorithm, density, selector, topology, bucket_cap_mb, backward_passes_per_step,
                        dense, overlap, error_feedback, non_finite, grad_scaler, values, indices, options)
    return wrapped


def broadcast_parameters(module: Any, root: int = 0, comm: Optional[MPI.Comm] = None) -> None:
    """Overwrite every parameter and buffer of ``module`` (an ``nn.Module``, or
    an iterable of (name, tensor)) with ``root``'s, in place. Collective; a
    rank whose tensors differ in name, shape or dtype from root's gets
    ConfigError on every rank, before anything is overwritten."""
    comm = comm or job_comm()
    require_job_world(comm, "spar_comm.torch.broadcast_parameters")
    named = list(module.state_dict().items()) if isinstance(module, torch.nn.Module) else list(module)
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in named]
    # Patient: at start-up, where ranks arrive after set-ups of their own.
    with waiting.watched("broadcast_parameters", comm, patient=True), torch.no_grad():
        reference = comm.bcast(layout, root=root)
        problem = None
        if layout != reference:
            problem = f"its tensors differ from rank {root}'s: {_first_difference(layout, reference)}"
        raise_if_any(comm, problem)
        for _, tensor in named:
            host = tensor.detach().to("cpu").contiguous()  # a GPU tensor goes through the host: once, at start-up
            comm.Bcast(host.numpy(), root=root)
            if tensor.device.type != "cpu" or host.data_ptr() != tensor.data_ptr():
                tensor.copy_(host)


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root: int = 0,
                              comm: Optional[MPI.Comm] = None) -> None:
    """Give every rank ``root``'s optimizer state and hyper-parameters (the
    wrapped optimizer's own; residuals stay each rank's). Collective."""
    comm = comm or job_comm()
    require_job_world(comm, "spar_comm.torch.broadcast_optimizer_state")
    own = torch.optim.Optimizer.state_dict(optimizer) if comm.rank == root else None
    with waiting.watched("broadcast_optimizer_state", comm, patient=True):
        state = comm.bcast(own, root=root)  # pickled: once, at start-up
    problem = None
    if comm.rank != root:
        try:
            torch.optim.Optimizer.load_state_dict(optimizer, state)
        except (ValueError, KeyError, TypeError) as error:
            problem = f"cannot take rank {root}'s optimizer state: {error}"
    raise_if_any(comm, problem)


# -- construction helpers ------------------------------------------------------------------
def _named_parameters(optimizer: torch.optim.Optimizer, named: Optional[Iterable]) -> Tuple[List, Optional[str]]:
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


def _settings_problem(named: List, dense: Sequence[Any], bucket_cap_mb: Any, passes: Any,
                      non_finite: Any) -> Optional[str]:
    if not named:
        return "the optimizer has no parameters that take gradients"
    problem = non_finite_problem(non_finite)
    if problem:
        return problem
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        return f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}"
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        return f"backward_passes_per_step must be an integer >= 1, got {passes!r}"
    names = {n for n, _ in named}
    unknown = [d for d in dense if isinstance(d, str) and d not in names]
    if unknown:
        return f"dense= names no parameter: {', '.join(map(repr, unknown))}"
    for name, p in named:
        if p.dtype not in _DTYPES:
            return f"parameter {name!r} is {p.dtype}; the allreducers take float32, float64, float16 and bfloat16"
    devices = sorted({str(p.device) for _, p in named})
    if len(devices) > 1:
        return f"the parameters are on several devices ({', '.join(devices)}): put the model on one"
    return None


def _device_problem(named: List, memory: Any) -> Optional[str]:
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


def _bucket_entries(named: List, dense: Sequence[Any], cap_mb: float) -> List[Tuple[str, List]]:
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


def _signature(entries: Iterable[Tuple[str, torch.Tensor]]) -> List[Tuple[str, Tuple[int, ...], str]]:
    """What every rank's bucket must agree on: names, shapes and dtypes."""
    return [(name, tuple(p.shape), _DTYPES[p.dtype]) for name, p in entries]


def _require_same_buckets(comm: MPI.Comm, signature: List) -> None:
    """ConfigError on every rank unless every rank formed the same buckets."""
    everyone = comm.allgather(signature)  # pickled: once, at construction
    problems = [
        f"rank {r}: {_first_difference(_flat(theirs), _flat(everyone[0]))}"
        for r, theirs in enumerate(everyone) if theirs != everyone[0]
    ]
    if problems:
        raise ConfigError("ranks formed different gradient buckets (the models differ): " + "; ".join(problems)
                          + " (compared with rank 0)")


def _flat(signature: List) -> List:
    return [entry for bucket in signature for entry in bucket]


def _first_difference(mine: List, reference: List) -> str:
    for a, b in zip(mine, reference):
        if a != b:
            return f"{a} where the reference has {b}"
    return f"{len(mine)} tensors where the reference has {len(reference)}"


def _own_state(saved: Any, rank: int, world_size: int, signature: List) -> Tuple[List, Optional[str]]:
    """This rank's residuals, as (span, values) a bucket, from a saved
    ``spar_comm`` entry of format 3, 2 or 1, or why they cannot be loaded."""
    if not isinstance(saved, dict) or saved.get("format") not in (1, 2, STATE_FORMAT):
        return [], ("the state_dict has no spar_comm entry of format "
                    f"{STATE_FORMAT}, 2 or 1 (was it saved by a DistributedOptimizer?)")
    if saved.get("world_size") != world_size:
        return [], (f"the state_dict was saved by {saved.get('world_size')} ranks; this job has {world_size}: "
                    f"{OTHER_WORLD}")
    theirs = [[tuple((n, tuple(s), d)) for n, s, d in bucket] for bucket in saved.get("buckets", [])]
    if theirs != [[tuple(e) for e in bucket] for bucket in signature]:
        if len(theirs) != len(signature):
            return [], f"the state_dict has {len(theirs)} gradient buckets; this optimizer has {len(signature)}"
        return [], f"the state_dict's gradient buckets differ: {_first_difference(_flat(signature), _flat(theirs))}"
    if saved["format"] == 1:  # every rank's residuals, a list by rank
        everyone = saved.get("residuals")
        if not isinstance(everyone, list) or len(everyone) != world_size:
            return [], f"the state_dict's residuals are not {world_size} lists (one a rank)"
        entries = everyone[rank]
        if not isinstance(entries, list) or len(entries) != len(signature):
            return [], f"the state_dict's residuals of this rank are not {len(signature)} (span, values)"
    else:
        buckets, problem = own_residuals(saved.get("residuals"), rank, world_size, "the state_dict")
        if problem is not None:
            return [], problem
        if not isinstance(buckets, dict) or sorted(buckets) != sorted(f"bucket{i}" for i in range(len(signature))):
            return [], f"the state_dict's residuals of this rank are not {len(signature)} buckets (bucket0, ...)"
        entries = [_span_and_values(buckets[f"bucket{i}"]) for i in range(len(signature))]
    return _residuals_checked(entries)


def _span_and_values(entry: Any) -> Any:
    """A bucket's ``(span, values)``: a tuple in format 3, a dict in format 2."""
    return (entry.get("span"), entry.get("values")) if isinstance(entry, dict) else entry


def _residuals_checked(entries: List) -> Tuple[List, Optional[str]]:
    """(span, values) a bucket, each span two integers and its values that many finite numbers."""
    out = []
    for bucket, entry in enumerate(entries):
        try:
            span, values = entry
            lo, hi = (int(x) for x in (span.tolist() if isinstance(span, torch.Tensor) else span))
            ok = isinstance(values, torch.Tensor) and values.dim() == 1 and len(values) == hi - lo
            ok = ok and bool(torch.isfinite(values).all())
        except (TypeError, ValueError):
            ok = False
        if not ok:
            return [], f"the state_dict's residual of this rank, bucket {bucket}, is not finite values for its span"
        out.append(((lo, hi), values.detach().cpu().numpy()))
    return out, None


def _stateful_problem(saved: Dict[str, Any], state: Any) -> Optional[str]:
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


def _choice_problem(saved: Any, mine: List[str]) -> Optional[str]:
    """Under ``algorithm="auto"``: other allreducers than the saved job's
    cannot take its residuals as they are (a state saved before the
    algorithms were kept is taken as before)."""
    if saved is None:
        return None
    if not isinstance(saved, list) or len(saved) != len(mine) or not all(isinstance(a, str) for a in saved):
        return f"the state_dict's algorithms are not {len(mine)} names, one a bucket"
    if saved == mine:
        return None
    return (f"algorithm='auto' chose {mine} for the buckets here and {saved} in the saved job (it prices the "
            "link between nodes as it times it at the start): give both jobs the same figures with "
            "SPAR_COMM_CALIBRATION, or name the algorithm the saved job chose")
