"""The outer loop of local-step training (DiLoCo, SparseLoCo) around the
user's own optimizer.

    outer = sct.OuterLoop(model.named_parameters(), every=30, algorithm="hitopk", density=0.02)
    for batch in data:
        loss(model, batch).backward()
        inner.step(); inner.zero_grad()      # the user's optimizer, each rank on its own
        outer.step()                         # every 30th call: the ranks synchronise

Each rank takes ``every`` inner steps alone. Then each bucket's
pseudo-gradient, the change of its weights since the outer step began, is
reduced across ranks by the bucket's allreducer (error feedback keeping what
a sparse one left out), and the outer optimizer (``spar_comm/outer.py``:
Nesterov as DiLoCo, or error feedback alone as SparseLoCo) applies the mean
to the weights the step began from, which every rank then takes: the same
bits everywhere. The buckets, their allreducers, ``auto``'s pricing and the
non-finite rule are the torch engine's (``engine.py``), as for
``DistributedOptimizer``; the reductions run on the caller's thread, in
bucket order, once every ``every`` calls.

With ``overlap=tau`` (Streaming DiLoCo's overlap, arXiv 2501.18512) the
reductions run on a thread of their own while the next ``tau`` inner steps
compute: at an outer step a rank hands its pseudo-gradient to the thread and
goes on from its own weights; ``tau`` inner steps later it waits for the
mean, steps the start with it, and takes the start plus its own progress
since the outer step. The start is the same bits on every rank; the
weights are each rank's own until ``synchronize()``.
"""
from __future__ import annotations

import hashlib
import numbers
import threading
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ..collectives import Allreducer
from ..consensus import raise_if_any, require_same
from ..outer import OuterSettings, OuterStep
from ..topology import Topology
from . import buckets
from .broadcast import broadcast_parameters
from .comm_thread import CommThread
from .engine import Engine, EngineOwner, reduction_of
from .state import (bucket_residual_entries, bucket_residuals, choice_problem, format_problem, own_residuals,
                    rank_key)
from .streams import streams_for
from .world import job_comm, require_job_world

__all__ = ["OuterLoop", "OUTER_STATE_FORMAT"]

#: ``OuterLoop.state_dict()["format"]``: the outer state every rank holds
#: alike (``start`` and ``velocity``, ``bucket{i}`` a flat tensor), the calls
#: since the last outer step, the density, and this rank's own under its
#: rank's key: ``residuals["rank{r}"]["bucket{i}"]`` a ``(span, values)``
#: tuple, and ``local["rank{r}"]`` its weights (a tuple of flat tensors, one
#: a bucket: between two outer steps each rank's own; always there, so that
#: a fresh loop's state is a template ``torch.distributed.checkpoint`` fills).
OUTER_STATE_FORMAT = 1

#: Why a state saved on another number of ranks is refused.
OUTER_OTHER_WORLD = (
    "the outer loop resumes on the number of ranks that saved it (each rank's residual covers its span of a "
    "bucket, and the spans follow the number of ranks; between two outer steps each rank's weights are its own). "
    "Resume on that many ranks, or save right after an outer step and start a fresh OuterLoop on the new world "
    "from the saved weights (the residuals are then lost)"
)


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def outer_problem(every: Any, lr: Any, momentum: Any, nesterov: Any) -> Optional[str]:
    """Why the outer settings cannot run, or None (``OuterSettings.problem``, after the types)."""
    if isinstance(every, bool) or not isinstance(every, numbers.Integral):
        return f"the outer loop's period (every=) must be an integer >= 1, got {every!r}"
    for name, value in (("lr", lr), ("momentum", momentum)):
        if not _number(value):
            return f"the outer {name} must be a number, got {value!r}"
    if not isinstance(nesterov, bool):
        return f"nesterov must be True or False, got {nesterov!r}"
    return OuterSettings(int(every), float(lr), float(momentum), nesterov).problem()


def named_tensors(named: Any) -> Tuple[List[Tuple[str, torch.Tensor]], Optional[str]]:
    """(name, parameter) pairs from ``named_parameters()`` or ``parameters()``
    (named ``param.<i>``), or why not."""
    if isinstance(named, torch.nn.Module):
        named = named.named_parameters()
    try:
        items = list(named)
    except TypeError:
        return [], f"OuterLoop takes model.named_parameters() or model.parameters(), got {type(named).__name__}"
    pairs = [(f"param.{i}", p) if isinstance(p, torch.Tensor) else tuple(p) for i, p in enumerate(items)]
    if not all(len(pair) == 2 and isinstance(pair[1], torch.Tensor) for pair in pairs):
        return [], "OuterLoop takes model.named_parameters() or model.parameters(): (name, tensor) pairs or tensors"
    names = [name for name, _ in pairs]
    if len(set(names)) != len(names):
        return [], "named_parameters has repeated names"
    return pairs, None


class _OuterBucket(buckets.FlatBucket):
    """Parameters synchronised together (``FlatBucket``: the allreducer
    reads the pseudo-gradient from the flat buffer), and the outer step's
    state of the bucket (``OuterStep``: the start and the velocity)."""

    def __init__(self, entries: List[Tuple[str, torch.Tensor]], reducer: Allreducer, settings: OuterSettings,
                 overlap: int):
        super().__init__(entries, reducer)
        self.gather()
        self.outer = OuterStep(settings, self.flat)  # a copy: the start, alike on every rank after the broadcast
        # What this rank's progress is counted from: the start itself, or under
        # overlap its own weights at the last outer step until the mean is merged.
        self.anchor = self.outer.start.clone() if overlap else self.outer.start

    def gather(self) -> None:
        """This rank's weights into the flat buffer."""
        for view, p in zip(self.views, self.params):
            view.copy_(p.detach())

    def scatter(self, flat: torch.Tensor) -> None:
        """Set the parameters from a flat vector of the bucket."""
        start = 0
        for p in self.params:
            p.detach().copy_(flat[start : start + p.numel()].view(p.shape))
            start += p.numel()

    def pseudo_gradient(self) -> None:
        """``anchor - weights``, this period's progress, into the flat buffer
        (``OuterStep.pseudo_gradient``, in place)."""
        self.gather()
        torch.sub(self.anchor, self.flat, out=self.flat)

    def restart(self) -> None:
        """The parameters and the anchor at the start, as every rank holds it."""
        if self.anchor is not self.outer.start:
            self.anchor.copy_(self.outer.start)
        self.scatter(self.outer.start)

    def merge(self) -> None:
        """Under overlap, once the start took the mean: this rank's weights the
        start plus its progress since the anchor, counted from the start on."""
        self.gather()
        self.flat.sub_(self.anchor).add_(self.outer.start)
        self.scatter(self.flat)
        self.anchor.copy_(self.outer.start)


class _Reduction:
    """One outer step's reductions on the loop's thread, at the density of
    the step that handed them over: done when set, with the CUDA event they
    finished on and the errors raised on every rank."""

    def __init__(self, produced: Any, density: float):
        self.produced, self.density, self.finished, self.errors = produced, density, None, []
        self.ledgers: List[Dict[str, float]] = []
        self.done = threading.Event()


class OuterLoop(EngineOwner):
    """Local steps with an outer step every ``every`` calls of ``step()``
    (DiLoCo's, or SparseLoCo's with a sparse allreducer): see the module's
    docstring. One object holds the whole state (``state_dict()``).

    Args:
        named_parameters: ``model.named_parameters()`` (or ``parameters()``,
            named ``param.<i>``): the parameters the ranks synchronise, those
            that take gradients, in buckets of about ``bucket_cap_mb``.
            Buffers (BatchNorm's statistics) stay each rank's own.
        every: the inner steps between two outer steps (DiLoCo's H).
        algorithm, density, selector, values, indices, error_feedback: the
            pseudo-gradient's allreducer, as for ``spar_comm.make_allreducer``
            (``options`` too: ``max_density``, ``powersgd``'s ``rank``), one a
            bucket; ``auto`` prices per bucket. Set ``outer.density`` between
            outer steps, up to ``max_density``, alike on every rank.
        lr, momentum, nesterov: the outer optimizer (``spar_comm/outer.py``).
            By default SparseLoCo's error feedback alone, lr 1 and no momentum
            (for a dense allreducer: the mean of the ranks' weights); DiLoCo
            takes lr 0.7 and Nesterov momentum 0.9, for periods of hundreds
            of steps.
        bucket_cap_mb, dense: the buckets, as for ``DistributedOptimizer``
            (``dense``: names or tensors never sparsified).
        overlap: 0, or the inner steps (1 to ``every``) that each outer
            step's reduction runs beside, on a thread, before its mean is
            taken (see the module's docstring). Between outer steps each
            rank's weights are then its own; ``synchronize()`` takes the
            pending mean and one more outer step, and gives every rank the
            same bits.
        non_finite: a NaN or Inf in any rank's pseudo-gradient:
            ``"propagate"`` makes its bucket's mean NaN on every rank, applied
            as it is (the weights and the outer state of the bucket NaN alike,
            as a NaN mean gradient makes them); ``"raise"``:
            NonFiniteGradientError from ``step()`` on every rank, the outer
            step skipped: every rank back at the start (the weights the period
            began from, without overlap), residuals as they were.
        topology, process_group, transport: the ranks, as for
            ``DistributedOptimizer``: torch.distributed's group when it is
            initialised, else MPI's world.

    Raises:
        ConfigError: on every rank, naming the problem, for bad or disagreeing
            settings (``every`` below 1, an ``lr`` not above 0, a momentum
            outside [0, 1)), models that differ, or ranks that are not the
            torch job's.

    Example:
        >>> outer = OuterLoop(model.named_parameters(), every=30, algorithm="hitopk", density=0.02, values="int8")
        >>> loss.backward(); inner.step(); inner.zero_grad(); outer.step()

    Collective: every rank constructs it with the same model and calls
    ``step()`` as often. Construction gives every rank rank 0's parameters.
    """

    def __init__(self, named_parameters: Iterable[Any], every: int = 30, *, algorithm: str = "hitopk",
                 density: float = 0.02, lr: float = OuterSettings.lr, momentum: float = OuterSettings.momentum,
                 nesterov: bool = OuterSettings.nesterov, selector: str = "mstopk", values: Optional[str] = None,
                 indices: Optional[str] = None, error_feedback: bool = True, non_finite: str = "propagate",
                 bucket_cap_mb: float = 25, dense: Sequence[Any] = (), overlap: int = 0,
                 topology: Optional[Topology] = None, process_group: Any = None, transport: Optional[str] = None,
                 **options: Any):
        comm = topology.world if topology is not None else job_comm(process_group, transport)
        require_job_world(comm, "spar_comm.torch.OuterLoop")
        reduction = reduction_of(algorithm, non_finite, options, density=density, selector=selector,
                                 error_feedback=error_feedback, shared_buffer=True, values=values, indices=indices)
        given, problem = named_tensors(named_parameters)
        named = [(name, p) for name, p in given if p.requires_grad]
        problem = problem or outer_problem(every, lr, momentum, nesterov) or reduction.problem()
        steps = not isinstance(overlap, bool) and isinstance(overlap, numbers.Integral)
        if problem is None and not (steps and (overlap == 0 or 1 <= overlap <= every)):
            problem = (f"overlap must be 0 or the inner steps in [1, every={every}] that the outer reduction "
                       f"runs beside, got {overlap!r}")
        problem = problem or buckets.settings_problem(named, tuple(dense), bucket_cap_mb, 1)
        raise_if_any(comm, problem)
        dense_names = [d if isinstance(d, str) else f"tensor{tuple(d.shape)}" for d in dense]
        plan = {"every": int(every), "lr": lr, "momentum": momentum, "nesterov": nesterov,
                "bucket_cap_mb": bucket_cap_mb, "dense": dense_names, "overlap": overlap}
        require_same(comm, "OuterLoop settings", {**reduction.agreed(), **plan})
        if topology is None:
            topology = Topology(comm, device="gpu" if named[0][1].device.type == "cuda" else "cpu")
        raise_if_any(topology.world, buckets.device_problem(named, topology.memory))
        broadcast_parameters(given, comm=topology.world)  # every rank starts from rank 0's weights
        self._comm = topology.world
        if overlap:  # communicators of its own, that the thread's reductions alone use (collective)
            topology = Topology(topology.world, topology.emulated_ranks_per_node, topology.memory.name)
        self.reduction, self.topology, self.plan = reduction, topology, plan
        self._engine = Engine(reduction, topology.world)
        self._streams = streams_for(topology.memory)
        self.buckets: List[_OuterBucket] = []
        self.settings = OuterSettings(int(every), float(lr), float(momentum), nesterov)
        with torch.no_grad():
            for entries, reducer in self._engine.make_buckets(topology, named, tuple(dense), bucket_cap_mb):
                self.buckets.append(_OuterBucket(entries, reducer, self.settings, overlap))
        self.inner_steps = 0  # calls of step() since the last outer step
        self.outer_steps = 0
        self.overlap = int(overlap)
        self._unmerged = False  # the start took a mean that the weights have not
        #: The allreducers' ledgers (``Allreducer.last``: bytes, times) of the
        #: last outer step whose reductions finished, one a bucket.
        self.ledgers: List[Dict[str, float]] = []
        self._thread = CommThread("spar_comm-outer-loop", self._reduce) if overlap else None
        self._in_flight: Optional[_Reduction] = None

    @property
    def every(self) -> int:
        """The inner steps between two outer steps."""
        return self.settings.every

    # -- the loop ------------------------------------------------------------------------
    def step(self) -> bool:
        """Count an inner step; under overlap, on the ``overlap``-th since an
        outer step take its mean; on every ``every``-th take the outer step
        (``synchronize``, or under overlap hand it to the thread). True where
        it took one. Call it after the inner optimizer's ``step()``, as often
        on every rank."""
        self.inner_steps += 1
        if self.inner_steps == self.overlap:
            self._merge()
        if self.inner_steps < self.every:
            return False
        if self.overlap:
            self._hand_over()
        else:
            self.synchronize()
        return True

    def synchronize(self) -> None:
        """The outer step now, whatever the count (at the end of training, or
        before an evaluation that needs every rank alike): each bucket's
        pseudo-gradient reduced in bucket order, then the outer optimizer
        applied to the start, which every rank's parameters become (under
        overlap, after the pending outer step). Collective.

        Raises:
            NonFiniteGradientError: under ``non_finite="raise"``, on every rank
                alike; SparCommError for any other reduction refused on every
                rank (a density past ``max_density``). The outer step is then
                skipped: every rank's weights go back to the start, residuals
                as they were."""
        self._merge()
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.pseudo_gradient()
            self._in_flight = _Reduction(self._streams.produced(), self._engine.density)
            self._reduce(self._in_flight)  # here, on the caller's thread
            self.outer_steps += 1
            self._finish()  # the mean onto the start; a refusal raised, every rank back at the start
            self._restart()  # every rank at the new start

    def _hand_over(self) -> None:
        """Under overlap, at an outer step: this rank's progress since the
        anchor to the thread's reduction; the weights stay its own, and the
        anchor becomes them."""
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.gather()
                progress = torch.sub(bucket.anchor, bucket.flat)  # the pseudo-gradient
                bucket.anchor.copy_(bucket.flat)
                bucket.flat.copy_(progress)
            self._in_flight = _Reduction(self._streams.produced(), self._engine.density)
            self._thread.put(self._in_flight)
        self.inner_steps = 0
        self.outer_steps += 1

    def _reduce(self, job: _Reduction) -> None:
        """One outer step's reductions, every bucket's pseudo-gradient in place
        in bucket order: on the loop's thread under overlap, on the caller's
        in ``synchronize()``. An error that is not every rank's ends the job."""
        try:
            with self._engine.job("the outer loop's reduction"):
                self._engine.begin_step([bucket.reducer for bucket in self.buckets])
                self._engine.step_density = job.density  # not one set since the hand-over
                with self._streams.communicating([] if job.produced is None else [job.produced]):
                    for bucket in self.buckets:
                        self._engine.reduce(bucket.reducer, bucket.flat, bucket.reducer.buffer)
                    job.finished = self._streams.finished()
            job.errors = self._engine.end_step()
            job.ledgers = [dict(bucket.reducer.last) for bucket in self.buckets]
        finally:
            job.done.set()

    def _finish(self) -> None:
        """Wait for the reduction in flight, if any, and step the start with
        its mean; where it raised (on every rank alike), every rank goes back
        to the start and the error is raised here."""
        job, self._in_flight = self._in_flight, None
        if job is None:
            return
        job.done.wait()
        self._streams.consume(job.finished)
        if job.errors:
            self._restart()
            self.outer_steps -= 1  # a refused outer step is not one
            raise job.errors[0]
        self.ledgers = job.ledgers
        for bucket in self.buckets:
            bucket.outer.step(bucket.flat)
        self._unmerged = True

    def _merge(self) -> None:
        """Under overlap: the start stepped with the mean in flight, and each
        rank's weights the start plus its own progress since the outer step."""
        with torch.no_grad():
            self._finish()
            if self._unmerged:
                for bucket in self.buckets:
                    bucket.merge()
                self._unmerged = False

    def _restart(self) -> None:
        for bucket in self.buckets:
            bucket.restart()
        self.inner_steps = 0
        self._unmerged = False

    # -- state ---------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The outer loop's state: its format, the world size, the settings and
        bucket layout, the density, the calls since the last outer step and
        the outer steps taken; the outer optimizer's ``start`` and
        ``velocity`` (``bucket{i}``: the tensors themselves, alike on every
        rank: save before the next outer step); and this rank's own under
        its rank's key: ``residuals["rank{r}"]`` (as
        ``DistributedOptimizer``'s) and ``local["rank{r}"]``, copies of its
        weights (its own between two outer steps), which ``load_state_dict``
        gives back to the parameters. Under overlap, ``anchors["rank{r}"]``
        too, what its progress is counted from, and ``unmerged``: whether the
        start took a mean the weights have yet to take. The reduction in
        flight is waited for and its mean taken on the start first (the
        weights take it at the step they would have: the same bits).

        Local. Each rank saves and loads its own: ``torch.save`` to a file a
        rank, or ``torch.distributed.checkpoint`` (``sct.save_checkpoint``) of
        every rank's state, which keeps each rank's keys apart. Save the
        inner optimizer's state beside it."""
        job = self._in_flight
        if job is not None:  # a refusal stays for the step that takes the mean, which raises it on every rank
            job.done.wait()
        with torch.no_grad():
            if job is not None and not job.errors:
                self._finish()
            local = tuple(torch.cat([p.detach().reshape(-1) for p in bucket.params]) for bucket in self.buckets)
        anchors = {"anchors": {rank_key(self._comm.rank): tuple(b.anchor.clone() for b in self.buckets)},
                   "unmerged": self._unmerged}
        return {
            "format": OUTER_STATE_FORMAT,
            "world_size": self._comm.size,
            "settings": {**self.reduction.to_dict(), **self.plan},
            "buckets": [bucket.signature() for bucket in self.buckets],
            "algorithms": [bucket.reducer.name for bucket in self.buckets],
            "values": [bucket.reducer.settings.values for bucket in self.buckets],
            "density": self.density,
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
            "start": {f"bucket{i}": bucket.outer.start for i, bucket in enumerate(self.buckets)},
            "velocity": {f"bucket{i}": bucket.outer.velocity for i, bucket in enumerate(self.buckets)},
            "residuals": {rank_key(self._comm.rank): bucket_residual_entries(
                [bucket.reducer for bucket in self.buckets], self._engine.scale)},
            "local": {rank_key(self._comm.rank): local},
            **(anchors if self.overlap else {}),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what this rank's ``state_dict()`` returned, in a job of the
        same number of ranks and buckets: the outer state, this rank's
        residuals, the counts and the density, and the parameters (this
        rank's weights as saved). A resume goes on to the same bits as a run
        that never stopped (with the inner optimizer's state loaded too).
        Under overlap the reduction in flight is waited for and its mean
        taken on the start first, whether the state is taken or refused. A
        state saved without overlap counts progress from the start; one saved
        with it loads without too, each rank's progress since the start then
        reduced at the next outer step.

        Raises:
            ConfigError: on every rank, before anything is loaded, where any
                rank's state does not fit: another format (named), another
                number of ranks (refused: see ``OUTER_OTHER_WORLD``), other
                buckets, another rank's residuals, or outer states that differ
                between ranks. Collective."""
        with torch.no_grad():
            self._finish()  # the thread's reduction writes the residuals a load replaces
        problem = format_problem(state, OUTER_STATE_FORMAT, self._comm.size, "the outer loop's state",
                                 "spar_comm.torch.OuterLoop.state_dict()", OUTER_OTHER_WORLD)
        residuals: List = []
        if problem is None:
            residuals, problem = bucket_residuals(state, self._comm.rank, self._comm.size,
                                                  [bucket.signature() for bucket in self.buckets],
                                                  "the outer loop's state")
        if problem is None:
            problem = choice_problem(state, [bucket.reducer for bucket in self.buckets], self.reduction.algorithm,
                                     self.reduction.allreducer.values)
        outer: List[Tuple[torch.Tensor, torch.Tensor]] = []
        local: Any = ()
        anchors: Any = None
        if problem is None:
            outer, local, problem = self._outer_state(state)
        if problem is None and self.overlap and "anchors" in state:
            anchors, problem = self._own_flats(state, "anchors", "anchors (what its progress is counted from)")
            if problem is None and not isinstance(state.get("unmerged"), bool):
                problem = f"the outer loop's state's unmerged ({state.get('unmerged')!r}) must be True or False"
        unmerged = problem is None and anchors is not None and state["unmerged"]
        digest = None
        if problem is None:  # what every rank must hold alike after the load
            sha = hashlib.sha256(repr((state["inner_steps"], float(state["density"]), unmerged)).encode())
            for tensors in outer:
                for t in tensors:
                    sha.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            digest = sha.hexdigest()
        raise_if_any(self._comm, problem)
        if len(set(self._comm.allgather(digest))) > 1:
            raise_if_any(self._comm, "the ranks loaded different outer states (start, velocity, counts or density): "
                                     "each rank must load a state saved by the same job at the same step")
        for bucket, (span, values) in zip(self.buckets, residuals):
            if bucket.reducer.keeps_residual:
                bucket.reducer.load_residual_state(span, np.asarray(values) * self._engine.scale)
        with torch.no_grad():
            for i, (bucket, (start, velocity)) in enumerate(zip(self.buckets, outer)):
                bucket.outer.start.copy_(start)
                bucket.outer.velocity.copy_(velocity)
                bucket.restart()
                if anchors is not None:
                    bucket.anchor.copy_(anchors[i])
                bucket.scatter(local[i])
        self.inner_steps, self.outer_steps = int(state["inner_steps"]), int(state.get("outer_steps", 0))
        self.density = float(state["density"])
        self._unmerged = unmerged

    def _outer_state(self, state: Dict[str, Any]) -> Tuple[List, Any, Optional[str]]:
        """The saved (start, velocity) of each bucket and this rank's local
        weights, checked against the buckets, or why not."""
        what = "the outer loop's state"
        counts = state.get("inner_steps"), state.get("density")
        if not isinstance(counts[0], int) or not 0 <= counts[0] < self.every or not _number(counts[1]):
            return [], (), (f"{what}'s inner_steps ({counts[0]!r}) must be an integer in [0, every={self.every}) "
                            f"and its density ({counts[1]!r}) a number")
        outer = []
        for i, bucket in enumerate(self.buckets):
            pair = []
            for name in ("start", "velocity"):
                saved = state.get(name)
                tensor = saved.get(f"bucket{i}") if isinstance(saved, dict) else None
                if not isinstance(tensor, torch.Tensor) or tensor.shape != bucket.outer.start.shape:
                    return [], (), f"{what}'s {name} of bucket {i} is not a tensor of its {bucket.flat.numel()} values"
                pair.append(tensor)
            outer.append(tuple(pair))
        local, problem = self._own_flats(state, "local", "local weights")
        return (outer, local, None) if problem is None else ([], (), problem)

    def _own_flats(self, state: Dict[str, Any], key: str, what: str) -> Tuple[Any, Optional[str]]:
        """This rank's entry of ``state[key]``, a flat tensor a bucket, or why not."""
        flats, problem = own_residuals(state.get(key), self._comm.rank, self._comm.size, f"the outer loop's {what}")
        if problem is not None:
            return None, problem
        sizes = [bucket.flat.numel() for bucket in self.buckets]
        if not isinstance(flats, (tuple, list)) or [t.numel() if isinstance(t, torch.Tensor) else -1
                                                     for t in flats] != sizes:
            return None, f"the outer loop's {what} of this rank are not {len(sizes)} flat tensors of its buckets"
        return flats, None
