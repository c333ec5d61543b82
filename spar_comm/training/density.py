"""Density schedules: how much a sparse allreduce sends at each step.

A schedule is called with the step and returns that step's density; the
training loop shows it every reduced update through ``observe``. Every rank
must compute the same density at the same step (the allreducer refuses a
call whose ranks ask for different ones), and ``most`` is the largest it can
return, by which the allreducer's buffers are sized (``aids.ScheduledAllreduce``):

* ``fixed``: the target density throughout;
* ``warmup`` (DGC, Lin et al., ICLR'18): the density falls exponentially from
  a start to the target over the first epochs; a pure function of the step;
* ``accordion`` (Agarwal et al., MLSys'21): a high density in *critical
  regimes*, where the gradient changes fast, the target elsewhere. At the end
  of each epoch it compares the norm of the epoch's accumulated update with
  the last epoch's; a relative change of at least ``eta`` means a critical
  regime, and the next epoch sends ``high``. The first epoch is taken as
  critical. It accumulates the *reduced* update, which every rank holds to
  the bit, so every rank reaches the same verdict without a message. Its
  state (the accumulated update, the last norm, the density) is explicit and
  goes into the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

import array_api_compat
import numpy as np

SCHEDULES = ("fixed", "warmup", "accordion")


class Fixed:
    """The target density at every step."""

    def __init__(self, target: float):
        self.target = target

    def __call__(self, step: int) -> float:
        return self.target

    @property
    def most(self) -> float:
        """The largest density of any step."""
        return self.target

    def observe(self, step: int, reduced: Any, xp: Any) -> None:
        """Pure schedules ignore what was reduced."""

    def describe(self) -> str:
        return ""


@dataclass(frozen=True)
class DensityWarmup(Fixed):
    """The density of each step: ``start * (target/start)**(epoch/epochs)`` in
    the first ``epochs`` epochs, then ``target``. A pure function of the step,
    so every rank (and a resumed run) computes the same schedule."""

    target: float
    start: float
    epochs: int
    steps_per_epoch: int

    def __call__(self, step: int) -> float:
        epoch = step // self.steps_per_epoch
        if epoch >= self.epochs or self.start <= self.target:
            return self.target
        return self.start * (self.target / self.start) ** (epoch / self.epochs)

    @property
    def most(self) -> float:
        return max(self.start, self.target)

    def describe(self) -> str:
        return f" (warm-up from {self(0):g} over {self.epochs} epochs)" if self(0) != self.target else ""


class Accordion(Fixed):
    """Accordion's switch between ``target`` and ``high``, decided once an
    epoch from the relative change of the accumulated update's norm."""

    def __init__(self, target: float, high: float, eta: float, steps_per_epoch: int):
        super().__init__(target)
        self.high, self.eta, self.steps_per_epoch = high, eta, steps_per_epoch
        self.density = high  # the first epoch is critical
        self.previous_norm: Optional[float] = None
        self.accumulated: Any = None

    def __call__(self, step: int) -> float:
        return self.density

    @property
    def most(self) -> float:
        return max(self.high, self.target)

    def observe(self, step: int, reduced: Any, xp: Any) -> None:
        if self.accumulated is None:
            self.accumulated = xp.zeros_like(reduced)
        self.accumulated += reduced
        if (step + 1) % self.steps_per_epoch == 0:
            self.decide(float(xp.sqrt(xp.sum(self.accumulated * self.accumulated))))
            self.accumulated[...] = 0

    def decide(self, norm: float) -> None:
        """The density of the next epoch, from this epoch's norm and the last one's."""
        previous, self.previous_norm = self.previous_norm, norm
        if previous is None:
            return
        critical = previous == 0 or abs(previous - norm) / previous >= self.eta
        self.density = self.high if critical else self.target

    def describe(self) -> str:
        return f" (accordion: {self.high:g} in critical regimes, eta {self.eta:g})"

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint keeps: the epoch's accumulated update (None before the
        first step), the last epoch's norm (-1 before the first epoch ends) and the density."""
        return dict(accumulated=self.accumulated, previous_norm=-1.0 if self.previous_norm is None else
                    self.previous_norm, density=self.density)

    def load_state_dict(self, state: Dict[str, Any], xp: Any, like: Any) -> None:
        """Restore ``state_dict``'s values; ``like`` gives the accumulator's dtype and device."""
        accumulated = state["accumulated"]
        self.accumulated = None if accumulated is None else xp.asarray(
            np.asarray(accumulated), dtype=like.dtype, device=array_api_compat.device(like))
        self.previous_norm = None if state["previous_norm"] < 0 else float(state["previous_norm"])
        self.density = float(state["density"])


def accordion_high(target: float, high: float) -> float:
    """Accordion's high density: ``high`` if given (non-zero), else ten times the target, at most 1."""
    return high if high else min(1.0, 10 * target)


def make_schedule(kind: str, target: float, steps_per_epoch: int, *, warmup_start: float = 0.25,
                  warmup_epochs: int = 4, high: float = 0.0, eta: float = 0.5) -> Fixed:
    """The schedule ``kind`` (one of ``SCHEDULES``) for a run at ``target`` density."""
    if kind == "warmup":
        return DensityWarmup(target, warmup_start, warmup_epochs, steps_per_epoch)
    if kind == "accordion":
        return Accordion(target, accordion_high(target, high), eta, steps_per_epoch)
    if kind == "fixed":
        return Fixed(target)
    raise ValueError(f"density schedule must be one of {', '.join(SCHEDULES)}, got {kind!r}")
