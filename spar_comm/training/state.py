"""A run's state as one value: everything ``train`` continues from.

A checkpoint saves a ``TrainState`` and a resume restores one
(``save_checkpoint(state, path)``, ``load_checkpoint(saved, path, state)``),
so a new piece of state is a field here, not one more parameter of both.
Its parts keep their own state dicts where they have one (the density
schedule's, the allreducer's residual and shared state), as nanoGPT's
checkpoint is a dict of state dicts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from ..costmodel.auto import Pricing
from .aids import ScheduledAllreduce
from .config import TrainConfig
from .data import Shards
from .distributed import Group
from .layout import ParamLayout


@dataclass
class TrainState:
    """What a run continues from, held by reference: the loop updates the
    arrays in place, and ``step`` as it goes."""

    group: Group
    config: TrainConfig
    layout: ParamLayout
    params: Any  # the flat parameters
    velocity: Any  # the optimizer's momentum buffer
    allreduce: ScheduledAllreduce  # this rank's residual, the allreducer's shared state
    shards: Shards  # the data order
    schedule: Any  # the density schedule (Accordion's is stateful)
    pricing: Optional[Pricing] = None  # what algorithm="auto" priced: the plan a resume chooses by
    local_velocity: Any = None  # the convergence aids' per-rank velocity (momentum correction)
    step: int = 0  # steps done

    @property
    def priced(self) -> Optional[Dict[str, Any]]:
        """``pricing`` as a checkpoint holds it."""
        return None if self.pricing is None else self.pricing.to_state()

    @property
    def schedule_state(self) -> Optional[Dict[str, Any]]:
        """The density schedule's state, where it has one (the same on every rank)."""
        return self.schedule.state_dict() if hasattr(self.schedule, "state_dict") else None
