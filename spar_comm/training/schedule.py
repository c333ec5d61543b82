"""The learning rate as a pure function of the step, so a resumed run needs
no schedule state: linear warm-up, then cosine decay to zero, step decay,
or the peak throughout."""
from __future__ import annotations

import math


SCHEDULES = ("cosine", "step", "constant")


class LearningRate:
    """``lr(step)`` for a run of ``total`` steps.

    ``cosine``: half a cosine from the peak to 0 over the steps after warm-up.
    ``step``: the peak divided by 10 at 50% and again at 75% of the run.
    ``constant``: the peak (with which an outer step of period 1 computes the
    per-step algorithm's update, the residual's units being the same).
    """

    def __init__(self, peak: float, total: int, warmup: int = 0, kind: str = "cosine"):
        if kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {kind!r}")
        self.peak, self.total, self.warmup, self.kind = float(peak), int(total), int(warmup), kind

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return self.peak * (step + 1) / self.warmup
        done = (step - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "cosine":
            return self.peak * 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))
        if self.kind == "constant":
            return self.peak
        return self.peak * 0.1 ** ((done >= 0.5) + (done >= 0.75))
