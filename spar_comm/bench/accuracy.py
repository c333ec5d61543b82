"""The cells of drivers/bench_accuracy.py and their table: which runs
answer "how much accuracy do the convergence aids buy back at low density",
each the run train.py would make with the same flags."""
from __future__ import annotations

import dataclasses
import math
import shlex
import statistics
from typing import Any, Dict, List, Sequence

from ..errors import ConfigError
from ..training import TrainConfig, train
from ..training.command_line import config_from, make_parser

#: The aids switched off: what "aids off" changes of a TrainConfig.
AIDS_OFF = dict(momentum_correction=False, momentum_masking=False, density_schedule="fixed", density_warmup=0,
                clip_norm=0.0)
#: The aids a set such as "mc+warmup" may name; each named one is on, the others off.
#: "accordion" is Accordion's density schedule instead of DGC's warm-up.
AID_PARTS = ("mc", "mask", "warmup", "accordion")
#: The baseline cell every other is measured against.
DENSE = "dense"


def aid_set(text: str) -> str:
    """An --aids item: "on" (train.py's defaults), "off", or aids of AID_PARTS joined by "+"."""
    parts = text.split("+")
    if text not in ("on", "off") and not (set(parts) <= set(AID_PARTS) and len(set(parts)) == len(parts)
                                          and not {"warmup", "accordion"} <= set(parts)):
        raise ValueError(text)
    return text


def aid_changes(name: str, base: TrainConfig) -> Dict:
    """What the aid set ``name`` changes of ``base``."""
    if name == "on":
        return {}
    parts = set(name.split("+")) if name != "off" else set()
    return dict(AIDS_OFF, momentum_correction="mc" in parts, momentum_masking="mask" in parts,
                density_warmup=base.density_warmup if "warmup" in parts else 0,
                density_schedule=next((p for p in ("warmup", "accordion") if p in parts), "fixed"))


def base_config(workload: str, algorithm: str = "hitopk") -> TrainConfig:
    """train.py's config for ``workload`` with ``algorithm``, without a trace or
    a progress bar. A bad flag is a usage message and exit status 2 on every rank."""
    flags = shlex.split(workload)
    for owned in ("algorithm", "density", "seed"):
        if any(flag == f"--{owned}" or flag.startswith(f"--{owned}=") for flag in flags):
            raise ConfigError(f"--workload sets --{owned}, which this program chooses per cell")
    args = make_parser().parse_args([*flags, "--algorithm", algorithm, "--trace", "", "--no-progress"])
    config = config_from(args)
    problems = config.problems()
    if problems:
        raise ConfigError("--workload: " + "; ".join(problems))
    return config


def cells(densities: Sequence[float], algorithm: str, aids: Sequence[str], dense_values: Sequence[str],
          seeds: Sequence[int]) -> List[Dict]:
    """Every run: dense first, then dense through each value codec, then
    ``algorithm`` at each density with each aid set, each seed."""
    runs = [{"cell": DENSE, "algorithm": DENSE, "density": 1.0, "aids": None}]
    runs += [{"cell": f"{DENSE} {values}", "algorithm": DENSE, "density": 1.0, "aids": None, "values": values}
             for values in dense_values]
    for d in densities:
        runs += [{"cell": f"{algorithm} {d:g} aids {state}", "algorithm": algorithm, "density": d,
                  "aids": state} for state in aids]
    return [{**run, "seed": seed} for run in runs for seed in seeds]


def run_cell(base: TrainConfig, cell: Dict, comm: Any) -> Dict:
    """Train ``cell`` (collective over ``comm``); the cell with its figures."""
    changes = dict(algorithm=cell["algorithm"], density=cell["density"], seed=cell["seed"])
    if cell["algorithm"] == DENSE:  # a --workload's codecs and rank are not for dense; its own values are
        changes.update(values=cell.get("values"), indices=None, rank=1)
    if cell["aids"]:
        changes.update(aid_changes(cell["aids"], base))
    summary = train(dataclasses.replace(base, **changes), comm)
    return {**cell, "final_metric": summary.test_metric, "train_loss": summary.train_loss, "steps": summary.steps,
            "wall": summary.wall, "mean_density": summary.density, "bytes_inter": summary.bytes_inter}


def table(runs: List[Dict]) -> str:
    """One line per cell: mean, spread and distance from dense of the final
    metric, and the mean density sent a step (a density schedule raises it)."""
    groups: Dict[str, List[float]] = {}
    sent: Dict[str, List[float]] = {}
    for run in runs:
        groups.setdefault(run["cell"], []).append(run["final_metric"])
        sent.setdefault(run["cell"], []).append(run.get("mean_density", math.nan))
    dense = statistics.fmean(groups[DENSE]) if DENSE in groups else None
    lines = [f"{'cell':<34} {'mean':>7} {'std':>7} {'min':>7} {'max':>7} {'vs dense':>9} {'seeds':>5} {'sent':>8}"]
    for cell, values in groups.items():
        mean = statistics.fmean(values)
        spread = statistics.stdev(values) if len(values) > 1 else 0.0
        gap = f"{100 * (mean - dense):+8.2f}p" if dense is not None and cell != DENSE else f"{'-':>9}"
        lines.append(f"{cell:<34} {mean:7.4f} {spread:7.4f} {min(values):7.4f} {max(values):7.4f} {gap} {len(values):>5} "
                     f"{statistics.fmean(sent[cell]):8.4g}")
    return "\n".join(lines)


