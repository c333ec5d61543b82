"""A communication hook for ``DistributedDataParallel``: DDP's buckets reduced
by spar_comm's allreducers.

    state, hook = sct.comm_hook("hitopk", density=0.001)
    ddp_model.register_comm_hook(state, hook)      # before the first backward

Each DDP bucket gets its own allreducer, built on the bucket's first call.
The hook hands the bucket to a communication thread and returns a
``torch.futures.Future`` at once, so reduction overlaps backward. The thread
reduces buckets in index order, whatever order DDP calls the hook in, so the
MPI collectives of all ranks match (a hook that starts collectives as
buckets arrive can mismatch them on gloo). On CUDA tensors the bucket is
reduced on a stream of its own after an event of the producing stream, and
the future carries the end of that work to DDP (``streams.py``).

Residuals live per parameter, so that they survive DDP's bucket rebuild
after the first iteration. A parameter's coordinate is where DDP put it in
the first iteration of the process (bucket index, position in the bucket),
which depends only on the model and DDP's settings, not on the run, so a
fresh process resuming a checkpoint finds each parameter's residual again.
When a bucket is built, a parameter's residual goes into the allreducer
where that rank's allreducer keeps residuals for those positions; what lies
elsewhere (the bucket layout changed) is carried: added to the rank's next
gradient of that parameter, which conserves it (the allreducer sums ranks'
gradients before selecting).
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..collectives import Allreducer
from ..consensus import raise_if_any, require_same
from ..errors import SparCommError
from ..topology import Topology
from .backward_end import EndOfBackward, after_queued
from .comm_thread import CommThread
from .engine import Engine, EngineOwner, InOrder, Reduction, reduction_of
from .state import HOOK_STATE_FORMAT, Coordinate, hook_residuals, rank_key
from .streams import NoStreams, as_tensor, streams_for
from .world import job_comm, require_job_world


class _Job:
    """One call of the hook: a bucket to reduce and the future to complete."""

    def __init__(self, bucket: Any, future: torch.futures.Future, produced: Any):
        self.index = bucket.index()
        self.is_last = bucket.is_last()
        self.buffer: torch.Tensor = bucket.buffer()
        self.params: List[torch.Tensor] = list(bucket.parameters())
        self.future = future
        self.produced = [] if produced is None else [produced]
        self.to_future = False  # an error goes on the future (a bucket handed over outside backward)


class _HookBucket:
    """A DDP bucket's allreducer and where its parameters lie in the buffer."""

    def __init__(self, params: List[torch.Tensor], reducer: Allreducer):
        self.params = params
        self.key = [id(p) for p in params]
        self.reducer = reducer
        self.offsets = np.cumsum([0] + [p.numel() for p in params]).tolist()

    def residual_of(self, i: int, full: Any) -> Any:
        """Parameter ``i``'s part of a bucket-sized array."""
        return full[self.offsets[i] : self.offsets[i + 1]]


class HookState(EngineOwner):
    """The hook's state: one allreducer per DDP bucket, and the residuals.

    ``state_dict()`` / ``load_state_dict()`` carry this rank's residuals in
    parameter coordinates (see the module's docstring), between iterations;
    ``load_state_dict`` is collective."""

    def __init__(self, reduction: Reduction, topology: Optional[Topology], comm: Any, grad_scaler: Any):
        self.reduction = reduction
        self.topology = topology
        self._comm: Any = comm  # the ranks it works over (``world.job_comm``)
        self._engine = Engine(reduction, comm, grad_scaler)
        self._streams: NoStreams = NoStreams() if topology is None else streams_for(topology.memory)
        self.buckets: Dict[int, _HookBucket] = {}
        self._coordinates: Dict[int, Coordinate] = {}  # id(parameter) -> coordinate
        self._carry: Dict[int, torch.Tensor] = {}  # id(parameter) -> residual held outside any allreducer
        self._loaded: Dict[Coordinate, np.ndarray] = {}  # residuals loaded, waiting for their parameter
        self._order = InOrder()  # the hook's buckets, reduced in index order
        self._busy = 0  # jobs handed over and not yet done with
        self._idle = threading.Condition()
        self._thread: Optional[CommThread] = None
        self._backward_end = EndOfBackward(lambda: after_queued(self._iteration_ended))  # after DDP's own
        self._taken: Dict[int, torch.Tensor] = {}  # id(parameter) -> carry taken this iteration

    # -- the hook (autograd's thread) ----------------------------------------------------
    def submit(self, bucket: Any) -> torch.futures.Future:
        buffer = bucket.buffer()
        if self._thread is None:
            if self.topology is None:  # collective, on every rank's first bucket (index order or not)
                self.topology = Topology(self._comm, device="gpu" if buffer.is_cuda else "cpu")
                self._streams = streams_for(self.topology.memory)
            self._engine.price(self.topology)  # collective: here, where every rank's backward waits for it
            self._thread = CommThread("spar_comm-ddp-hook", self._arrived)
        future = torch.futures.Future(devices=[buffer.device]) if buffer.is_cuda else torch.futures.Future()
        job = _Job(bucket, future, self._streams.produced())
        # Outside backward (a bucket handed over by hand) the future carries the errors.
        job.to_future = not self._backward_end.arm()
        with self._idle:
            self._busy += 1
        self._thread.put(job)
        return future

    def _iteration_ended(self) -> None:
        """As backward ends, after DDP has finished the iteration's buckets:
        where a bucket held NaN or Inf on any rank, put back every residual and
        carry the iteration's reductions took (the step will be skipped). Then
        raise out of ``backward()`` what a reduction raised on every rank, with
        spar_comm's own type and message: DDP is done with the iteration and
        stays usable (a hook that raises, or a future that fails, would leave
        it broken for good)."""
        self._wait_idle()
        if self._engine.overflowed:
            for key, values in self._taken.items():
                self._carry[key] = self._carry[key] + values if key in self._carry else values
        self._taken = {}
        errors = self._engine.end_step()
        if errors:
            raise errors[0]

    # -- the communication thread ---------------------------------------------------------
    def _arrived(self, job: _Job) -> None:
        """Run the buckets in index order, on every rank alike, whatever order DDP hands them over in."""
        for ready in self._order.arrived(job.index, job, last=job.is_last):
            self._run(ready)

    def _run(self, job: _Job) -> None:
        with self._engine.job(f"spar_comm.torch DDP hook, bucket {job.index}", agreed=False), \
                self._streams.communicating(job.produced):
            if job.is_last:
                self._retire(lambda index: index > job.index)  # buckets DDP no longer has
            if job.index == 0:  # the iteration's first bucket: none is being reduced
                self._taken = {}
                self._engine.begin_step([b.reducer for b in self.buckets.values()], self._carry.values())
            result = job.future.set_result, job.buffer
            try:
                bucket = self._bucket(job)
                self._reduce(bucket, job)
            except SparCommError as error:  # raised on every rank alike
                if job.to_future:
                    result = job.future.set_exception, error
                else:  # DDP takes a NaN bucket and finishes; backward then raises the error
                    self._engine.errors.append(error)
                    job.buffer.fill_(float("nan"))
            with self._idle:  # done with this job before DDP, woken by the future, may ask for the state
                self._busy -= 1
                self._idle.notify_all()
            result[0](result[1])

    def _bucket(self, job: _Job) -> _HookBucket:
        """The allreducer of this bucket, built (collectively) when DDP's bucket
        ``job.index`` is new or holds other parameters than before."""
        for position, p in enumerate(job.params):
            self._coordinates.setdefault(id(p), (job.index, position))
        known = self.buckets.get(job.index)
        if known is not None and known.key == [id(p) for p in job.params]:
            return known
        self._retire(lambda index: index == job.index)
        require_same(self.topology.world, f"DDP bucket {job.index}",
                     {"parameters": [(tuple(p.shape), str(p.dtype)) for p in job.params]})
        shapes = {"shapes": [tuple(p.shape) for p in job.params]} if self.algorithm == "powersgd" else {}
        reducer = self._engine.make(self.topology, job.buffer.numel(), str(job.buffer.dtype).replace("torch.", ""),
                                    **shapes)
        bucket = self.buckets[job.index] = _HookBucket(job.params, reducer)
        self._place(bucket)
        return bucket

    def _reduce(self, bucket: _HookBucket, job: _Job) -> None:
        """Add the carried residuals of the bucket's parameters, then allreduce in place."""
        carried = [(i, self._carry[id(p)]) for i, p in enumerate(bucket.params) if id(p) in self._carry]
        if carried:
            grads = job.buffer.clone()  # the carry is dropped only once the allreduce took it
            for i, values in carried:
                bucket.residual_of(i, job.buffer).add_(values.to(job.buffer.dtype))
        try:
            reduced = self._engine.reduce(bucket.reducer, job.buffer)
        except SparCommError:
            if carried:
                job.buffer.copy_(grads)
            raise
        if not reduced:  # NaN on every rank: nothing was taken, residuals and carry stay as they were
            return
        for i, values in carried:
            key = id(bucket.params[i])
            del self._carry[key]
            if self._engine.keep:
                self._taken[key] = values

    # -- residuals in parameter coordinates ------------------------------------------------
    def _place(self, bucket: _HookBucket) -> None:
        """Put the residuals loaded for the bucket's parameters where the new
        allreducer keeps them; carry the rest. Collective (every rank builds
        the same buckets at the same time)."""
        if not self.reduction.allreducer.error_feedback:
            return
        span, values = bucket.reducer.residual_state()
        full = np.zeros(bucket.reducer.size, dtype=values.dtype)
        problem = None
        for i, p in enumerate(bucket.params):
            saved = self._loaded.pop(self._coordinates[id(p)], None)
            if saved is None:
                continue
            if saved.shape != (p.numel(),):
                problem = (f"the hook state's residual at {self._coordinates[id(p)]} has {saved.size} values; "
                           f"the parameter there has {p.numel()} (another model or DDP bucket size?)")
                break
            bucket.residual_of(i, full)[...] = saved * self._engine.scale  # saved in the gradients' own units
        raise_if_any(self.topology.world, problem)
        lo, hi = span
        kept = full[lo:hi].copy()
        full[lo:hi] = 0
        bucket.reducer.load_residual_state(span, kept)
        for i, p in enumerate(bucket.params):
            rest = bucket.residual_of(i, full)
            if rest.any():
                self._add_carry(p, torch.from_numpy(rest.copy()))

    def _retire(self, which: Callable[[int], bool]) -> None:
        """Move the residuals of the buckets whose index ``which`` picks into the carry, and drop them."""
        for index in [i for i in self.buckets if which(i)]:
            bucket = self.buckets.pop(index)
            if bucket.reducer.keeps_residual:
                full = as_tensor(bucket.reducer.residual_full())
                for i, p in enumerate(bucket.params):
                    values = bucket.residual_of(i, full)
                    if bool(values.any()):
                        self._add_carry(p, values.clone())
            bucket.reducer.free()

    def _add_carry(self, p: torch.Tensor, values: torch.Tensor) -> None:
        values = values.to(p.device)
        self._carry[id(p)] = self._carry[id(p)] + values if id(p) in self._carry else values

    def residuals(self) -> Dict[Coordinate, np.ndarray]:
        """This rank's residual of every parameter it holds one for (allreducers
        and carry, flat, in the gradient's dtype and own units whatever the
        loss scale), by coordinate."""
        out: Dict[Coordinate, np.ndarray] = {c: v.copy() for c, v in self._loaded.items()}
        with self._streams.communicating([]):  # after the communication stream's work
            for bucket in self.buckets.values():
                if not bucket.reducer.keeps_residual:
                    continue
                full = bucket.reducer.memory.to_host(bucket.reducer.residual_full())
                for i, p in enumerate(bucket.params):
                    out[self._coordinates[id(p)]] = bucket.residual_of(i, full) / self._engine.scale
            for key, values in self._carry.items():
                coordinate = self._coordinates[key]
                host = values.detach().cpu().numpy() / self._engine.scale
                out[coordinate] = out[coordinate] + host if coordinate in out else host.copy()
        return out

    # -- the public interface --------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals by parameter coordinate, under
        ``["residuals"]["rank{r}"]``: a tuple of ``(bucket, position, values)``
        (``torch.distributed.checkpoint`` saves a tuple whole, as one object of
        this rank's, so a fresh state, which knows no parameter before its
        first iteration, is a template it loads into), beside the world size
        and the algorithm. Local: no rank's residuals reach another. Each rank
        loads its own (``torch.distributed.checkpoint``, or ``torch.save`` to a
        file per rank). Call it after backward."""
        self._wait_idle()
        mine = tuple((int(c[0]), int(c[1]), torch.from_numpy(np.ascontiguousarray(v)))
                     for c, v in sorted(self.residuals().items()))
        return {
            "format": HOOK_STATE_FORMAT,
            "world_size": self._comm.size,
            "algorithm": self.algorithm,
            "settings": self.reduction.to_dict(),
            "residuals": {rank_key(self._comm.rank): mine},
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take this rank's residuals from what its ``state_dict()`` returned
        in a job of the same size. Each parameter's residual reaches the
        allreducer of whichever bucket holds it next. Collective: a state that
        holds another rank's residuals (one rank's saved state loaded by every
        rank), or any mismatch on any rank, raises ConfigError on every rank,
        before anything is loaded."""
        self._wait_idle()
        mine, problem = hook_residuals(state, self._comm.rank, self._comm.size)
        raise_if_any(self._comm, problem)
        # What the state held is replaced: its allreducers are rebuilt on their
        # buckets' next calls and take the loaded residuals then.
        for bucket in self.buckets.values():
            bucket.reducer.free()
        self.buckets, self._carry = {}, {}
        self._loaded = mine

    def _wait_idle(self) -> None:
        """Wait for the communication thread to finish the buckets handed to it
        (the last ones complete their futures a moment before it is done)."""
        with self._idle:
            self._idle.wait_for(lambda: self._busy == 0)


def _hook(state, bucket):  # noqa: ANN001, ANN202 (DDP checks annotations against its own types; these would be strings)
    """DDP's side: hand the bucket over, get its future."""
    return state.submit(bucket)


def comm_hook(algorithm: str = "hitopk", density: float = 0.001, *, selector: str = "mstopk",
              topology: Optional[Topology] = None, error_feedback: bool = True, non_finite: str = "propagate",
              grad_scaler: Any = None, process_group: Any = None, transport: Optional[str] = None,
              values: Optional[str] = None, indices: Optional[str] = None, **options: Any
              ) -> Tuple[HookState, Callable[[HookState, Any], torch.futures.Future]]:
    """A communication hook that averages DDP's buckets with spar_comm's ``algorithm``.

    Args:
        algorithm, density, selector, values, indices, error_feedback: as for
            ``spar_comm.make_allreducer``, one allreducer per DDP bucket;
            ``options`` too (``max_density``; ``powersgd``'s ``rank``, which
            gets the bucket's tensor shapes). Set ``state.density`` between
            iterations, up to ``max_density``, alike on every rank.
        topology: the ranks; default: one built on the first bucket (on the
            GPU for CUDA buckets) over ``process_group`` (torch's default
            group, as torch's PowerSGD state uses: DDP never hands a hook its
            group) when torch.distributed is initialised, else MPI's world
            (``transport="mpi"`` keeps MPI).
        non_finite: ``"propagate"``: a NaN or Inf on any rank gives every rank
            a NaN bucket, residuals unchanged (``GradScaler`` skips the step
            everywhere); ``"raise"``: NonFiniteGradientError out of
            ``backward()`` on every rank, once DDP has finished the iteration
            (DDP stays usable), as any other error of a reduction.
        grad_scaler: the ``torch.amp.GradScaler`` in use, so that the residuals
            follow its scale.

    Returns:
        ``(state, hook)``: a ``HookState`` (``state_dict()``, ``load_state_dict()``)
        and the hook.

    Raises:
        ConfigError: here, on every rank (not inside backward, where DDP would
            not recover), for bad settings or ranks that are not the torch job's.

    Example:
        >>> state, hook = comm_hook("hitopk", density=0.01)
        >>> ddp_model.register_comm_hook(state, hook)   # before the first backward

    Collective over the ranks it works on.
    """
    comm = topology.world if topology is not None else job_comm(process_group, transport)
    require_job_world(comm, "spar_comm.torch.comm_hook")
    reduction = reduction_of(algorithm, non_finite, options, density=density, selector=selector,
                             error_feedback=error_feedback, values=values, indices=indices)
    raise_if_any(comm, reduction.problem())
    require_same(comm, "comm_hook settings", reduction.agreed())
    return HookState(reduction, topology, comm, grad_scaler), _hook
