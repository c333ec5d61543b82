"""The outer loop of local-step training (DiLoCo, SparseLoCo): each rank
takes ``every`` inner steps alone; then the change of its weights since
the outer step began, the pseudo-gradient ``start - weights``, is reduced
across ranks by any allreducer (a sparse one with error feedback), and an
outer optimizer applies the mean to the starting weights, which every rank
then takes, so that all hold the same bits again.

Two outer optimizers, as the literature has them:

* **Nesterov momentum** (DiLoCo, Douillard et al., arXiv 2311.08105):
  ``v = momentum*v + d;  start -= lr*(d + momentum*v)``; DiLoCo takes
  ``lr`` 0.7 and ``momentum`` 0.9 for periods of hundreds of steps;
* **error feedback alone** (SparseLoCo, arXiv 2508.15706), the default:
  ``lr`` 1 and no momentum, ``start -= d``: the mean of the ranks' weights
  for a dense allreducer; for a sparse one, what the top-k left out stays in
  the allreducer's residual and goes out at a later outer step.

The default is the second for every allreducer: on the digits MLP, 3 ranks,
``--sync-every 4``, DiLoCo's 0.7 and 0.9 on top of the inner SGD's own
momentum overshot (held-out accuracy 0.766 after 3 epochs and 0.836 after
10, dense), where lr 1 without momentum kept up with reducing every step
(0.928 and 0.972, against 0.928 and 0.975) (docs/training.md); on the GPT
with H = 8 DiLoCo's ended at a validation loss of 2.60 after 296 steps, lr 1
with hitopk at 2.35 (docs/results/local-steps.md).
With ``every`` 1, ``lr`` 1 and no momentum the outer step computes the
per-step algorithm's update, allclose and not bit for bit:
``start - (start - lr*u)`` rounds otherwise than ``lr*u``.

Written against the Python array API: the training loop's NumPy or CuPy
vectors and torch's flat buckets alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import array_api_compat


@dataclass(frozen=True)
class OuterSettings:
    """How often the ranks synchronise (``every`` inner steps) and the outer optimizer."""

    every: int
    lr: float = 1.0
    momentum: float = 0.0
    nesterov: bool = True

    def problem(self) -> Optional[str]:
        """Why these settings cannot run, or None."""
        if self.every < 1:
            return f"the outer loop's period must be >= 1 inner step, got {self.every}"
        if not self.lr > 0:
            return f"the outer learning rate must be > 0, got {self.lr}"
        if not 0 <= self.momentum < 1:
            return f"the outer momentum must be in [0, 1), got {self.momentum}"
        return None

    def describe(self) -> str:
        kind = "error feedback alone" if not self.momentum else ("Nesterov" if self.nesterov else "momentum")
        return (f"outer step every {self.every}: {kind}, lr {self.lr:g}"
                + (f", momentum {self.momentum:g}" if self.momentum else ""))


class OuterStep:
    """The outer optimizer's state: the weights the outer step started from
    (``start``) and its velocity, both the same on every rank."""

    def __init__(self, settings: OuterSettings, params: Any):
        xp = array_api_compat.array_namespace(params)
        self.settings = settings
        self.start = xp.asarray(params, copy=True)
        self.velocity = xp.zeros_like(params)

    def due(self, steps_done: int) -> bool:
        """Whether the ranks synchronise after ``steps_done`` inner steps."""
        return steps_done % self.settings.every == 0

    def pseudo_gradient(self, params: Any) -> Any:
        """This rank's change since the start, as a gradient (a new array: the allreducer overwrites its input)."""
        return self.start - params

    def apply(self, reduced: Any, params: Any) -> None:
        """Take the outer step with the ranks' reduced pseudo-gradient; every
        rank's ``params`` become the new start, in place."""
        self.step(reduced)
        params[...] = self.start

    def step(self, reduced: Any) -> None:
        """The outer optimizer's step on the start with the ranks' reduced pseudo-gradient."""
        s = self.settings
        update = reduced
        if s.momentum:
            self.velocity *= s.momentum
            self.velocity += reduced
            update = reduced + s.momentum * self.velocity if s.nesterov else self.velocity
        self.start -= update if s.lr == 1 else s.lr * update

    def restart(self, params: Any) -> None:
        """Start the next outer step from ``params`` (after a checkpoint is loaded or weights broadcast)."""
        self.start[...] = params
