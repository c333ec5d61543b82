"""SGD with momentum and weight decay on the flat parameter vector.

The update runs after the allreduce on bits that every rank shares, so all
ranks stay identical. Weight decay is added here, not before the allreduce:
it needs no communication and would only dilute the top-k selection.
"""
from __future__ import annotations

from typing import Any


class SGD:
    """``v = momentum*v + g + weight_decay*p;  p -= lr*v`` (PyTorch's form), in place."""

    def __init__(self, params: Any, xp: Any, momentum: float = 0.9, weight_decay: float = 0.0):
        self.xp = xp
        self.momentum = float(momentum)
        self.weight_decay = float(weight_decay)
        self.velocity = xp.zeros_like(params)

    def step(self, params: Any, grad: Any, lr: float) -> None:
        v = self.velocity
        v *= self.momentum
        v += grad
        if self.weight_decay:
            v += self.weight_decay * params
        params -= lr * v
