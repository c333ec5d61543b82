"""Convergence aids for low density, after Lin et al., "Deep Gradient
Compression" (ICLR'18): what lets top-k training at density 0.001 keep up
with dense training.

Each aid is a small transformation with explicit state, composed around the
allreducer by the training loop (optax is the model):

* **local gradient clipping**: each rank scales its gradient to a norm of at
  most ``clip_norm / sqrt(world size)`` before anything accumulates it, so
  one outlier batch cannot fill the residual with a huge value;
* **momentum correction**: each rank keeps a local velocity
  ``u = momentum*u + g + weight_decay*p`` and sends ``u``; the allreducer's
  error-feedback residual is then DGC's accumulator ``v``, and the global
  step applies the reduced update with plain SGD (no second momentum);
* **momentum factor masking** (off by default): ``u`` is cleared where
  values were *sent*, defined here as the positions where the reduced update
  is non-zero. That is the union of what every rank (gtopk: the tree's
  winners; hitopk: every node's shard selections) put on the wire, and every
  rank sees the same result, so all ranks clear the same positions without
  another message. (A selected value that is exactly zero leaves ``u`` alone
  there; its ``v`` was zero, so nothing was delayed.) Clearing a share of the
  velocity every step damps the momentum itself: the more is sent, the more
  it acts like plain SGD (at density 1 it is plain SGD). On the digits MLP it
  cost 0.3 to 2.5 points after 30 epochs and far more in short runs, and it
  never helped, so it is opt-in;
* **density warm-up**: the density falls exponentially from
  ``density_warmup_start`` to the target over the first
  ``density_warmup`` epochs (DGC's 0.25, 0.0625, 0.0156, 0.0039, then the
  target 0.001); it is one of the density schedules of ``density.py``,
  beside a fixed density and Accordion's. An allreducer's k is fixed (its
  exchange buffers are sized for it), so ``ScheduledAllreduce`` builds a new
  one when the density changes and carries the residual over.

Conservation holds for what enters the allreducer: summed over ranks and
steps, the reduced updates plus the residuals equal the sum of the ``u``
sent. The aids apply only to sparse algorithms; dense ones are unchanged.

By default momentum correction and the density warm-up are on, masking and
clipping off: measured on the digits MLP at densities 0.1 to 0.0001 and runs
of 3 to 30 epochs, that choice was never worse than no aids (beyond seed
noise) and kept short runs within two points of dense where no aids lost up
to 58 (docs/results/convergence-aids.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from ..collectives import ALGORITHMS
from ..costmodel import auto
from .config import TrainConfig
from .density import Fixed
from .distributed import FusedAllreduce, Group


def clip_by_norm(grad: Any, max_norm: float, xp: Any) -> float:
    """Scale ``grad`` in place to a 2-norm of at most ``max_norm``; returns the norm before."""
    norm = float(xp.sqrt(xp.sum(grad * grad)))
    if norm > max_norm:
        grad *= max_norm / norm
    return norm


@dataclass(frozen=True)
class MomentumCorrection:
    """DGC's local momentum: the velocity is this rank's state, ``update``
    turns a gradient into the velocity to send, ``mask`` clears what was sent."""

    momentum: float
    weight_decay: float
    masking: bool

    def init(self, params: Any, xp: Any) -> Any:
        return xp.zeros_like(params)

    def update(self, grad: Any, velocity: Any, params: Any) -> Tuple[Any, Any]:
        """``u = momentum*u + g + weight_decay*p``, in place; ``grad`` then holds ``u``
        (the allreducer overwrites its input, so the velocity must stay apart)."""
        velocity *= self.momentum
        velocity += grad
        if self.weight_decay:
            velocity += self.weight_decay * params
        grad[...] = velocity
        return grad, velocity

    def mask(self, velocity: Any, reduced: Any, xp: Any) -> Any:
        """Clear the velocity where the reduced update is non-zero (what was sent)."""
        if self.masking:
            velocity *= xp.astype(reduced == 0, velocity.dtype)
        return velocity


class LocalAids:
    """The per-rank aids of one run, with their state (the local velocity).

    ``before_allreduce`` clips and applies momentum correction to this rank's
    gradient; ``after_allreduce`` masks. ``optimizer_momentum`` and
    ``optimizer_weight_decay`` are what the global SGD must then use.
    """

    def __init__(self, config: TrainConfig, sparse: bool, world_size: int, params: Any, xp: Any):
        self.xp = xp
        on = sparse
        self.clip: Optional[float] = config.clip_norm / math.sqrt(world_size) if on and config.clip_norm else None
        self.correction = (MomentumCorrection(config.momentum, config.weight_decay, config.momentum_masking)
                           if on and config.momentum_correction else None)
        self.velocity = self.correction.init(params, xp) if self.correction else None
        self.optimizer_momentum = 0.0 if self.correction else config.momentum
        self.optimizer_weight_decay = 0.0 if self.correction else config.weight_decay

    def before_allreduce(self, grad: Any, params: Any) -> Any:
        if self.clip is not None:
            clip_by_norm(grad, self.clip, self.xp)
        if self.correction:
            grad, self.velocity = self.correction.update(grad, self.velocity, params)
        return grad

    def after_allreduce(self, reduced: Any) -> None:
        if self.correction:
            self.velocity = self.correction.mask(self.velocity, reduced, self.xp)


class ScheduledAllreduce:
    """A ``FusedAllreduce`` whose density follows a schedule.

    One allreducer serves every density the schedule can return: its buffers
    are sized for the largest (``schedule.most``), and each call asks for its
    step's, so a change of density rebuilds nothing and the residual stays
    where it is. Dense algorithms ignore the density. ``algorithm="auto"`` and
    ``values="auto"`` are resolved once by ``pricing``, at the target density.
    """

    def __init__(self, group: Group, algorithm: str, size: int, dtype: str, selector: str, schedule: Fixed,
                 options: Optional[dict] = None, pricing: Optional[auto.Pricing] = None):
        self.group, self.size, self.dtype, self.selector, self.schedule = group, size, dtype, selector, schedule
        values, indices = ((options or {}).get(name) for name in ("values", "indices"))
        if auto.chooses(algorithm, values):
            algorithm, values = auto.choice(group.topology, pricing, algorithm, size, dtype, schedule.target,
                                            selector, values, indices)
            options = dict(options or {}, values=values)
        known_sparse = algorithm in ALGORITHMS and ALGORITHMS[algorithm].sparse  # unknown: refused when built
        self.density = schedule(0) if known_sparse else schedule.target
        options = dict(options or {}, max_density=schedule.most) if known_sparse else options
        self.current: FusedAllreduce = group.allreducer(algorithm, size, dtype, self.density, selector, options)
        self.algorithm, self.values = self.current.reducer.name, self.current.reducer.settings.values

    def reduce(self, step: int, grad: Any, xp: Any) -> Any:
        """Step ``step``'s allreduce at its density; the schedule sees the result."""
        if self.current.sparse:
            self.density = self.schedule(step)
        reduced = self.current(grad, xp, self.density)
        if self.current.sparse:
            self.schedule.observe(step, reduced, xp)
        return reduced

    # The FusedAllreduce interface, for the loop and the checkpoint.
    def __call__(self, grad: Any, xp: Any) -> Any:
        return self.current(grad, xp, self.density)

    @property
    def last(self) -> dict:
        return self.current.last

    @property
    def sparse(self) -> bool:
        return self.current.sparse

    def residual(self, copy: bool = True) -> Tuple[Tuple[int, int], np.ndarray]:
        return self.current.residual(copy)

    def load_residual(self, span: Tuple[int, int], values: np.ndarray) -> None:
        self.current.load_residual(span, values)

    def shared_state(self) -> Optional[np.ndarray]:
        return self.current.shared_state()

    def load_shared_state(self, values: np.ndarray) -> None:
        self.current.load_shared_state(values)
