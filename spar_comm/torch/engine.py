"""The per-bucket work every torch way in shares.

A way in (the optimizer wrapper, the DDP hook) decides which tensors form a
bucket and when the bucket is ready; the engine does the rest, once:

* the settings, one value (``Reduction``), agreed across ranks as a whole
  and saved with the state;
* the allreducer of a bucket, with ``auto`` priced once for every bucket;
* the step's density, read as its first bucket starts, and the loss scale
  that the residuals follow (``GradScaler``'s, which changes by powers of two);
* the reduction of a bucket in place, with the non-finite rule: a NaN or Inf
  on any rank gives every rank a NaN bucket (or NonFiniteGradientError) and
  leaves every residual as the step found it;
* the communication thread's jobs, each ending the whole job on an error of
  one rank alone, which the others would wait for ever to hear of;
* buckets released in index order (``InOrder``), whatever order backward
  makes them ready in, so that the collectives of all ranks match.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from ..collectives import Allreducer, Settings
from ..costmodel import auto
from ..errors import NonFiniteGradientError, SparCommError
from ..launch import abort_job
from .buckets import DTYPES, bucket_entries, require_same_buckets, signature
from .streams import as_array

#: What a NaN or Inf in any rank's gradient does: a non-finite mean on every
#: rank (torch's convention, which GradScaler relies on), or NonFiniteGradientError.
NON_FINITE = ("propagate", "raise")


@dataclass(frozen=True)
class Reduction:
    """How a torch way in reduces its buckets: the algorithm (or ``auto``),
    its allreducer's settings, and what a non-finite gradient does."""

    algorithm: str = "hitopk"
    allreducer: Settings = field(default_factory=Settings)
    non_finite: str = "propagate"

    def problem(self) -> Optional[str]:
        """Why these settings cannot work, found before any allreducer is made, or None."""
        if self.non_finite not in NON_FINITE:
            return f"non_finite must be one of {', '.join(map(repr, NON_FINITE))}, got {self.non_finite!r}"
        return None

    def agreed(self) -> Dict[str, Any]:
        """The settings as plain values every rank must hold alike (``require_same``)."""
        return {"algorithm": self.algorithm, "non_finite": self.non_finite, **self.allreducer.agreed()}

    def to_dict(self) -> Dict[str, Any]:
        """As plain data, for a state dict (``torch.load(weights_only=True)`` reads it)."""
        return {"algorithm": self.algorithm, "non_finite": self.non_finite, "allreducer": self.allreducer.to_dict()}


class InOrder:
    """Releases items in index order from 0, whatever order they arrive in."""

    def __init__(self) -> None:
        self.next = 0  # the lowest index not yet released
        self._waiting: Dict[int, Any] = {}

    def arrived(self, index: int, item: Any, last: bool = False) -> List[Any]:
        """The items released by ``item``'s arrival, in order. Once an item
        that came ``last`` (the final index of a round) is released, the next
        round starts again from 0."""
        self._waiting[index] = (item, last)
        released = []
        while self.next in self._waiting:
            ready, ends_round = self._waiting.pop(self.next)
            released.append(ready)
            self.next = 0 if ends_round else self.next + 1
            if ends_round:
                break
        return released

    def restart(self) -> None:
        self.next = 0
        self._waiting.clear()


class Engine:
    """The reductions of one way in's buckets over ``comm`` (see the module's
    docstring). ``density`` is the next step's, settable between steps up
    to the settings' ``max_density``. ``among``: the algorithms ``auto`` may
    choose from (default: all), where a way in can use only some."""

    def __init__(self, reduction: Reduction, comm: Any, grad_scaler: Any = None,
                 among: Optional[Tuple[str, ...]] = None):
        self.reduction, self.comm, self.grad_scaler, self.among = reduction, comm, grad_scaler, among
        self.density = reduction.allreducer.density
        self.step_density = self.density
        self.scale = 1.0  # the loss scale the residuals are in units of
        self.pricing: Optional[auto.Pricing] = None  # what ``auto`` priced, once for every bucket
        # Where a step may be skipped (GradScaler, non_finite="raise"): the residuals
        # its reductions found, put back if a bucket overflowed on any rank.
        self.keep = grad_scaler is not None or reduction.non_finite == "raise"
        self._kept: List[Tuple[Allreducer, Any]] = []
        self.overflowed = False
        self.errors: List[SparCommError] = []  # raised on every rank alike, handed to the caller's thread

    def price(self, topology: Any) -> None:
        """Under ``auto`` (the algorithm or the values), price ``topology``
        for every bucket to come (collective: it may time the link between nodes)."""
        if auto.chooses(self.reduction.algorithm, self.reduction.allreducer.values):
            self.pricing = auto.price(topology)

    def make(self, topology: Any, size: int, dtype: str, dense: bool = False,
             **options: Any) -> Allreducer:
        """The allreducer of a bucket of ``size`` elements (collective).
        ``dense``: a bucket never sparsified, which takes the value codec
        alone. ``options``: the algorithm's own for this bucket (``powersgd``'s
        ``shapes``)."""
        settings = self.reduction.allreducer
        if dense:
            algorithm = "dense"
            settings = Settings(density=settings.density, selector=settings.selector,
                                error_feedback=settings.error_feedback, shared_buffer=settings.shared_buffer,
                                values=settings.values)
        else:
            algorithm = self.reduction.algorithm
            if options:
                settings = settings.replace(options={**settings.options, **options})
        return auto.build_allreducer(algorithm, topology, size, dtype, settings, self.pricing, self.among)

    def make_buckets(self, topology: Any, named: List, dense: Any, cap_mb: float) -> List[Tuple[List, Allreducer]]:
        """Price ``topology`` (under ``auto``), plan the buckets of ``named``
        (``buckets.bucket_entries``) alike on every rank, and make each one's
        allreducer: ``(entries, allreducer)`` a bucket, in index order.
        Collective; ConfigError on every rank where the ranks' buckets differ."""
        self.price(topology)
        planned = bucket_entries(named, dense, cap_mb)
        require_same_buckets(topology.world, [signature(entries) for _, entries in planned])
        made = []
        for kind, entries in planned:
            # powersgd's matrices are the layers'.
            shapes = {"shapes": [tuple(p.shape) for _, p in entries]} if self.reduction.algorithm == "powersgd" else {}
            reducer = self.make(topology, sum(p.numel() for _, p in entries), DTYPES[entries[0][1].dtype],
                                dense=kind == "dense", **shapes)
            made.append((entries, reducer))
        return made

    def begin_step(self, reducers: Iterable[Allreducer], carried: Iterable[torch.Tensor] = ()) -> None:
        """As a step's first bucket starts, on the communication thread: take the
        density set since, and put the residuals (and ``carried`` tensors of
        residual kept outside the allreducers) in the units of this step's
        gradients, scaled by ``grad_scaler``'s scale."""
        self._kept, self.overflowed = [], False
        self.step_density = self.density
        if self.grad_scaler is None:
            return
        scale = float(self.grad_scaler.get_scale())
        if scale != self.scale:
            for reducer in reducers:
                reducer.feedback.rescale(scale / self.scale)
            for values in carried:
                values.mul_(scale / self.scale)
            self.scale = scale

    def reduce(self, reducer: Allreducer, tensor: torch.Tensor, array: Any = None,
               finite: Optional[bool] = None) -> bool:
        """Allreduce ``tensor`` in place (through ``array``, its array, where the
        caller holds it: the allreducer's own ``buffer`` is read where it lies).
        False where a NaN or Inf on any rank made it NaN on every rank, with the
        residual as it was; NonFiniteGradientError instead under
        ``non_finite="raise"``. ``finite``: as ``Allreducer.allreduce``'s."""
        if self.keep and reducer.keeps_residual:
            self._kept.append((reducer, reducer.feedback.residual.copy()))
        array = as_array(tensor) if array is None else array
        try:
            reducer.allreduce(array, out=array, density=self.step_density if reducer.sparse else None,
                              finite=finite)
            return True
        except NonFiniteGradientError:  # raised on every rank alike
            self.overflowed = True
            if self.reduction.non_finite == "raise":
                raise
            tensor.fill_(float("nan"))
            return False

    def end_step(self) -> List[SparCommError]:
        """As the step ends, its buckets done: put back the residuals its
        reductions found where a bucket overflowed on any rank (the step will
        be skipped, alike on every rank). The errors its reductions raised on
        every rank, for the caller to raise."""
        if self.overflowed:
            for reducer, kept in self._kept:
                reducer.feedback.residual[...] = kept
        self._kept, self.overflowed = [], False
        errors, self.errors = self.errors, []
        return errors

    @contextlib.contextmanager
    def job(self, what: str, agreed: bool = True) -> Iterator[None]:
        """A job of the communication thread. A bucket's reduction (``agreed``)
        raises SparCommError on every rank alike: it is kept for the caller's
        thread. Any other error is this rank's alone (a bug, memory), which
        the others would wait for ever to hear of: it ends the whole job."""
        try:
            yield
        except SparCommError as error:
            if not agreed:
                abort_job(self.comm, what)
            self.errors.append(error)
        except BaseException:
            abort_job(self.comm, what)


class EngineOwner:
    """What a way in's state shows of its ``_engine``: the algorithm, the
    density, settable between steps up to ``max_density``, and what ``auto`` priced."""

    _engine: Engine

    @property
    def algorithm(self) -> str:
        return self._engine.reduction.algorithm

    @property
    def density(self) -> float:
        """The sparse buckets' density from the next step on: settable between
        steps, alike on every rank, up to ``max_density``."""
        return self._engine.density

    @density.setter
    def density(self, value: float) -> None:
        self._engine.density = value

    @property
    def pricing(self) -> Optional[auto.Pricing]:
        """What ``algorithm="auto"`` priced, on the first bucket (None otherwise)."""
        return self._engine.pricing


def reduction_of(algorithm: str, non_finite: str, options: Dict[str, Any], **settings: Any) -> Reduction:
    """The ``Reduction`` of a way in's keyword arguments: ``settings`` are
    ``Settings`` fields; ``options`` may hold more of them (``max_density``,
    ``selector_options``) beside the algorithm's own."""
    fields = {f.name for f in dataclasses.fields(Settings)}
    settings.update({key: value for key, value in options.items() if key in fields})
    own = {key: value for key, value in options.items() if key not in fields}
    return Reduction(algorithm, Settings(**settings, options=own), non_finite)
