"""Every setting of a training run, in one dataclass that the trace and the
checkpoint store as JSON, so that a run can be described, compared and resumed.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from ..outer import OuterSettings
from .density import SCHEDULES as DENSITY_SCHEDULES
from .schedule import SCHEDULES

MODELS = ("mlp", "softmax", "cnn")
DATASETS = ("digits", "synthetic")

#: Settings that may change when a run is resumed: they stop, trace or place
#: the run but do not change its bits.
RESUMABLE_CHANGES = frozenset(
    {"stop_after", "time_limit", "trace", "trace_every", "checkpoint", "checkpoint_every", "checkpoint_period",
     "resume", "progress"}
)


@dataclass
class TrainConfig:
    """The settings of one run; the defaults are those of ``make train``."""

    algorithm: str = "hitopk"
    selector: str = "mstopk"
    density: float = 0.01
    ranks_per_node: Optional[int] = None
    model: str = "mlp"
    dataset: str = "digits"
    hidden: int = 128
    depth: int = 2
    epochs: Optional[int] = None
    steps: Optional[int] = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    warmup: int = 20
    schedule: str = "cosine"
    # Convergence aids (DGC, see aids.py), for sparse algorithms; dense ones ignore them.
    # Momentum correction and the density warm-up are on, masking is off: the
    # measurements behind this choice are in docs/results/convergence-aids.md.
    momentum_correction: bool = True
    momentum_masking: bool = False
    density_schedule: str = "warmup"
    density_warmup: int = 4
    density_warmup_start: float = 0.25
    accordion_high: float = 0.0  # 0: ten times --density, at most 1
    accordion_eta: float = 0.5
    clip_norm: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    values: Optional[str] = None  # a value codec for the pairs on the wire (collectives/codecs.py)
    indices: Optional[str] = None  # an index codec for them
    rank: int = 1  # PowerSGD's rank (--algorithm powersgd)
    # The outer loop (spar_comm/outer.py): 0 reduces every step's gradient; H
    # takes H local steps, then reduces the pseudo-gradient and takes an outer
    # step, by default SparseLoCo's (error feedback alone).
    sync_every: int = 0
    outer_lr: float = OuterSettings.lr
    outer_momentum: float = OuterSettings.momentum
    outer_nesterov: bool = OuterSettings.nesterov
    device: str = "cpu"
    trace: Optional[str] = None
    trace_every: int = 10
    checkpoint: Optional[str] = None
    checkpoint_every: int = 0
    checkpoint_period: float = 600.0  # seconds of training between checkpoints, where checkpoint_every is 0
    resume: bool = False
    stop_after: Optional[int] = None
    time_limit: Optional[float] = None
    progress: bool = True

    def problems(self) -> List[str]:
        """What is wrong with these settings, each as one sentence (empty if none)."""
        # The codecs and devices are the collectives' own, which load MPI and the
        # kernels: imported here, where a run starts, not where a file is read.
        from ..collectives.checks import CODECS
        from ..collectives.codecs import INDICES, VALUES
        from ..memory import DEVICES  # where a run computes: cpu, gpu, or gpu-simulator (the GPU path on the CPU)

        found = []
        if self.model not in MODELS:
            found.append(f"--model must be one of {', '.join(MODELS)}, got {self.model!r}")
        if self.dataset not in DATASETS:
            found.append(f"--dataset must be one of {', '.join(DATASETS)}, got {self.dataset!r}")
        if self.schedule not in SCHEDULES:
            found.append(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.device not in DEVICES:
            found.append(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.dtype not in ("float32", "float64"):
            found.append(f"--dtype must be float32 or float64, got {self.dtype!r}")
        if not 0 < self.density <= 1:
            found.append(f"--density must be in (0, 1], got {self.density}")
        if not 0 < self.density_warmup_start <= 1:
            found.append(f"--density-warmup-start must be in (0, 1], got {self.density_warmup_start}")
        if self.density_schedule not in DENSITY_SCHEDULES:
            found.append(f"--density-schedule must be one of {', '.join(DENSITY_SCHEDULES)}, got {self.density_schedule!r}")
        if not 0 <= self.accordion_high <= 1 or (self.accordion_high and self.accordion_high < self.density):
            found.append(f"--accordion-high must be in [--density, 1] (or 0: ten times --density), "
                         f"got {self.accordion_high}")
        for setting, given, known in (("values", self.values, (*VALUES, "auto")), ("indices", self.indices, INDICES)):
            if given is not None and given not in known:
                found.append(f"--{setting} must be one of {', '.join(known)}, got {given!r}")
            elif given is not None and self.algorithm not in (*CODECS[setting], "auto"):
                found.append(f"--{setting} applies to {', '.join(CODECS[setting])}, "
                             f"not to --algorithm {self.algorithm}")
        if self.rank != 1 and self.algorithm != "powersgd":
            found.append(f"--rank applies to --algorithm powersgd, not to --algorithm {self.algorithm}")
        if not self.accordion_eta > 0:
            found.append(f"--accordion-eta must be > 0, got {self.accordion_eta}")
        if self.momentum_masking and not self.momentum_correction:
            found.append("--momentum-masking clears the corrected velocity: it needs momentum correction "
                         "(add --no-momentum-masking)")
        if self.sync_every < 0:
            found.append(f"--sync-every must be >= 0 (0: every step), got {self.sync_every}")
        elif self.sync_every:
            problem = self.outer().problem()
            if problem:
                found.append(f"--outer-lr / --outer-momentum: {problem}")
            if self.checkpoint_every % self.sync_every:
                found.append(f"--checkpoint-every {self.checkpoint_every} must be a multiple of --sync-every "
                             f"{self.sync_every}: a checkpoint is taken where the ranks hold the same weights")
            if self.algorithm in ("powersgd", "adasum"):
                found.append(f"--sync-every: --algorithm {self.algorithm} does not reduce pseudo-gradients "
                             "(PowerSGD's factors follow one gradient's matrices, Adasum's result is no mean)")
        elif any(getattr(self, f.name) != f.default for f in dataclasses.fields(self) if f.name.startswith("outer_")):
            found.append("--outer-lr, --outer-momentum and --no-outer-nesterov need --sync-every H")
        if self.epochs is not None and self.steps is not None:
            found.append("give --epochs or --steps, not both")
        positive = dict(
            rank=self.rank, hidden=self.hidden, depth=self.depth, batch_size=self.batch_size, trace_every=self.trace_every,
            epochs=self.epochs, steps=self.steps, stop_after=self.stop_after, ranks_per_node=self.ranks_per_node,
        )
        for name, value in positive.items():
            if value is not None and value < 1:
                found.append(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        non_negative = dict(
            lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay, warmup=self.warmup,
            checkpoint_every=self.checkpoint_every, checkpoint_period=self.checkpoint_period,
            density_warmup=self.density_warmup, clip_norm=self.clip_norm,
        )
        for name, value in non_negative.items():
            if value < 0:
                found.append(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.time_limit is not None and self.time_limit <= 0:
            found.append(f"--time-limit must be > 0 seconds, got {self.time_limit}")
        if self.resume and not self.checkpoint:
            found.append("--resume needs --checkpoint PATH")
        if (self.stop_after or self.time_limit or self.checkpoint_every) and not self.checkpoint:
            found.append("--stop-after, --time-limit and --checkpoint-every need --checkpoint PATH")
        if self.model == "cnn" and self.dataset != "digits":
            found.append("--model cnn takes 8x8 images: use it with --dataset digits")
        return found

    def outer(self) -> OuterSettings:
        """The outer loop's settings."""
        return OuterSettings(self.sync_every, self.outer_lr, self.outer_momentum, self.outer_nesterov)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TrainConfig":
        return cls(**json.loads(text))

    def differences(self, other: "TrainConfig") -> Dict[str, Any]:
        """Settings that differ from ``other`` and would change the run's bits."""
        mine, theirs = dataclasses.asdict(self), dataclasses.asdict(other)
        return {
            key: (theirs[key], mine[key])
            for key in mine
            if key not in RESUMABLE_CHANGES and mine[key] != theirs[key]
        }
