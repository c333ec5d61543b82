#!/usr/bin/env python3
"""Held-out accuracy at low density, with and without the convergence aids,
against dense: every cell after the same epochs, over several seeds.

Sparsification trades accuracy for bytes; the aids of Deep Gradient
Compression (momentum correction and masking, density warm-up, local
clipping) are meant to buy it back. This program answers how much of it they
buy back on one workload: for every --densities value it trains --algorithm
with each --aids set (by default: as train.py sets them, "aids on", and all
of them off, "aids off"), and it trains dense, each with every --seeds value,
all on the same ranks and emulated nodes; --dense-values adds dense with its
sums in narrower values (the compressed dense baseline, as DDP's fp16 hook
sends, with error feedback). One line per cell: mean, standard
deviation, lowest and highest final held-out accuracy, and the mean's
distance from dense in points. JSON goes to --out after every run, so a
killed sweep keeps what it measured.

    mpiexec -n 4 python drivers/bench_accuracy.py --out accuracy.json
    mpiexec -n 4 python drivers/bench_accuracy.py --workload "--hidden 1024 --epochs 10" --seeds 0,1,2
    mpiexec -n 4 python drivers/bench_accuracy.py --aids off,mc,mc+mask,mc+warmup --workload "--epochs 3"
    mpiexec -n 4 python drivers/bench_accuracy.py --densities 0.001 --aids on --dense-values float16,int8
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per rank, as train.py

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Dict, List  # noqa: E402

from mpi4py import MPI  # noqa: E402

from spar_comm import ALGORITHMS  # noqa: E402
from spar_comm.cli import comma_list  # noqa: E402
from spar_comm.collectives.codecs import VALUES  # noqa: E402
from spar_comm.consensus import raise_if_any  # noqa: E402
from spar_comm.errors import ConfigError  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402
from spar_comm.training import TrainConfig, train  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_comm import unwritable  # noqa: E402
from spar_comm.files import write_json  # noqa: E402
from train import config_from, make_parser  # noqa: E402

#: The aids switched off: what "aids off" changes of a TrainConfig.
AIDS_OFF = dict(momentum_correction=False, momentum_masking=False, density_schedule="fixed", density_warmup=0,
                clip_norm=0.0)
#: The aids a set such as "mc+warmup" may name; each named one is on, the others off.
#: "accordion" is Accordion's density schedule instead of DGC's warm-up.
AID_PARTS = ("mc", "mask", "warmup", "accordion")
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_accuracy.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--densities", type=comma_list(float, lambda d: 0 < d <= 1, "in (0, 1]"),
                        default=[0.01, 0.001, 0.0001], help="(default: 0.01,0.001,0.0001)")
    parser.add_argument("--algorithm", default="hitopk", choices=[a for a in ALGORITHMS if a != DENSE],
                        help="the sparse algorithm (default: %(default)s)")
    parser.add_argument("--aids", type=comma_list(aid_set, lambda a: True,
                                                  "on, off or a '+' of mc, mask, and warmup or accordion"),
                        default=["on", "off"], help="aid sets of every density: on (train.py's defaults), off, or "
                        "aids joined by '+' (mc: momentum correction, mask: momentum masking, warmup: DGC's density "
                        "warm-up, accordion: Accordion's density schedule), e.g. off,mc,mc+warmup,mc+accordion "
                        "(default: on,off)")
    parser.add_argument("--dense-values", type=comma_list(str, VALUES.__contains__, f"one of {', '.join(VALUES)}"),
                        default=[], help="also train dense with its sums in each of these value codecs, "
                        "e.g. float16,int8 (default: none)")
    parser.add_argument("--seeds", type=comma_list(int, lambda s: s >= 0, "an integer >= 0"), default=[0, 1, 2],
                        help="initial weights and data order of each run (default: 0,1,2)")
    parser.add_argument("--workload", default="",
                        help="train.py flags of every run, e.g. --workload=\"--hidden 1024 --epochs 10\" "
                             "(default: train.py's defaults, the digits MLP)")
    parser.add_argument("--out", help="JSON results")
    return parser.parse_args(argv)


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


def cells(args: argparse.Namespace) -> List[Dict]:
    """Every run: dense first, then dense through each value codec, then each
    density with each aid set, each seed."""
    runs = [{"cell": DENSE, "algorithm": DENSE, "density": 1.0, "aids": None}]
    runs += [{"cell": f"{DENSE} {values}", "algorithm": DENSE, "density": 1.0, "aids": None, "values": values}
             for values in args.dense_values]
    for d in args.densities:
        runs += [{"cell": f"{args.algorithm} {d:g} aids {state}", "algorithm": args.algorithm, "density": d,
                  "aids": state} for state in args.aids]
    return [{**run, "seed": seed} for run in runs for seed in args.seeds]


def run_cell(base: TrainConfig, cell: Dict, comm: MPI.Comm) -> Dict:
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


def main() -> int:
    args = parse_args()
    comm = MPI.COMM_WORLD
    lead = comm.rank == 0
    raise_if_any(comm, unwritable(args.out) if lead and args.out else None)
    base = base_config(args.workload, args.algorithm)
    document = {"meta": {**vars(args), "world_size": comm.size, "config": dataclasses.asdict(base)}, "runs": []}
    plan = cells(args)
    for number, cell in enumerate(plan, 1):
        if lead:
            print(f"# {number}/{len(plan)}: {cell['cell']}, seed {cell['seed']}", flush=True)
        document["runs"].append(run_cell(base, cell, comm))
        if lead and args.out:
            write_json(args.out, document)
    if lead:
        print(f"final held-out metric after {document['runs'][0]['steps']} steps on {comm.size} ranks "
              f"({args.workload or 'train.py defaults'}); aids on: train.py's defaults")
        print(table(document["runs"]))
    return 0


if __name__ == "__main__":
    run_main(main, "bench_accuracy.py")
