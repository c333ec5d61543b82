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

from mpi4py import MPI  # noqa: E402

from spar_comm import ALGORITHMS  # noqa: E402
from spar_comm.bench.accuracy import DENSE, aid_set, base_config, cells, run_cell, table  # noqa: E402
from spar_comm.bench.record import hosts_of, meta, refuse_unwritable  # noqa: E402
from spar_comm.cli import comma_list  # noqa: E402
from spar_comm.collectives.codecs import VALUES  # noqa: E402
from spar_comm.files import write_json  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402


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


def main() -> int:
    args = parse_args()
    comm = MPI.COMM_WORLD
    lead = comm.rank == 0
    refuse_unwritable(comm, args.out)
    base = base_config(args.workload, args.algorithm)
    document = {"meta": meta("bench_accuracy", hosts_of(comm), **vars(args), world_size=comm.size,
                             config=dataclasses.asdict(base)), "runs": []}
    plan = cells(args.densities, args.algorithm, args.aids, args.dense_values, args.seeds)
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
