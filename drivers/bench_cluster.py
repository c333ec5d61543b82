#!/usr/bin/env python3
"""Every algorithm on an emulated cluster with real rate-limited links (root).

For each host layout (e.g. 2 hosts x 2 ranks, 4 hosts x 1 rank) the cluster
is brought up once; for each link rate the links are reshaped and
drivers/bench_comm.py runs across the hosts: the sparse algorithms at every
density, together (their calls interleaved, so they compare like for like),
with --repeat calls each; the dense ones, which do not depend on the density
and take seconds a call at 100 Mbit/s, once per rate with --dense-repeat.
Results go to --out as JSON after every run (a killed sweep keeps what it
measured) and as one table at the end; the cluster is removed at the end, on
Ctrl-C and on failure.

    python drivers/bench_cluster.py --out cluster.json
    python drivers/bench_cluster.py --sweep nodes --out nodes.json --plot nodes.png
    python drivers/bench_cluster.py --time-to-accuracy --out tta.json --traces runs/tta

``--sweep nodes`` measures how each algorithm's time grows with the node
count: 2 to 16 hosts of 1 rank and 2 to 8 hosts of 2, 2^20 and 2^22 floats,
density 0.001, at 100 Mbit/s, 1 Gbit/s and unshaped. The unshaped links
leave only the CPU's share of a call (every rank runs on this machine's
cores), which the report sets against the shaped times. The cost model is
fitted on the cells of at most 4 hosts and asked for the 8- and 16-host
ones; ``--plot`` draws measured times and the model's lines against the
node count. Every cell also counts the bytes its call put on the links.

``--time-to-accuracy`` trains a communication-bound workload (``--workload``,
by default the digits MLP with 1.1M parameters at density 0.001) with every
``--tta-algorithms`` on every layout at every ``--tta-rates``, and reports
wall time and epochs to ``--target`` held-out accuracy, the final accuracy
after the same epochs, and the bytes sent between nodes, from the traces.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spar_comm import ALGORITHMS, emucluster
from spar_comm.bench.cluster import NODE_SWEEP, read_sweep, report
from spar_comm.bench.cluster_runs import ClusterSweep, bench_sweep, time_to_accuracy_sweep
from spar_comm.bench.record import meta
from spar_comm.cli import comma_list, positive_int, settings_from
from spar_comm.files import BadFileError, unwritable, write_json

#: This folder: bench_comm.py and train.py, which the runs start across the hosts.
DRIVERS = Path(__file__).resolve().parent
#: The communication-bound workload: the digits MLP with two hidden layers of
#: 1024 (1,126,410 parameters), 10 epochs, density 0.001 for the sparse ones.
WORKLOAD = "--hidden 1024 --epochs 10 --density 0.001"


def layouts(text: str) -> list:
    try:
        pairs = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"layouts are HOSTSxRANKS, comma-separated, e.g. 2x2,4x1; got {text!r}")
    if any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"layouts are HOSTSxRANKS with both >= 1, got {text!r}")
    return pairs


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_cluster.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layouts", type=layouts, default=[(2, 2), (4, 1)], help="HOSTSxRANKS list (default: 2x2,4x1)")
    parser.add_argument("--rates", type=comma_list(str, emucluster.RATE.match, "a tc rate such as 100mbit"), default=["100mbit", "1gbit", "10gbit"],
                        help="link rates, tc syntax (default: 100mbit,1gbit,10gbit)")
    parser.add_argument("--sizes", type=comma_list(int, lambda n: n >= 1, "an integer >= 1"), default=[1 << 22, 1 << 24], help="elements (default: 2^22,2^24)")
    parser.add_argument("--densities", type=comma_list(float, lambda d: 0 < d <= 1, "in (0, 1]"), default=[0.001, 0.01], help="(default: 0.001,0.01)")
    parser.add_argument("--algorithms", type=comma_list(str, ALGORITHMS.__contains__, f"one of {', '.join(ALGORITHMS)}"),
                        default=list(ALGORITHMS))
    parser.add_argument("--selector", default=None, help="top-k method (default: bench_comm's)")
    parser.add_argument("--repeat", type=positive_int, default=10, help="timed calls per sparse cell (default: %(default)s)")
    parser.add_argument("--dense-repeat", type=positive_int, default=3, help="timed calls per dense cell (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per cell (default: %(default)s)")
    parser.add_argument("--limit", type=float, default=1200, help="seconds one bench_comm run may take")
    parser.add_argument("--prefix", default="spb", help="name prefix of the cluster made (default: %(default)s)")
    parser.add_argument("--out", help="JSON results")
    parser.add_argument("--train", type=lambda text: [a for a in text.split(",") if a], default=["dense", "hitopk"],
                        help="algorithms whose default training run is timed to --target accuracy "
                             "on the first layout at --train-rate ('' for none; default: dense,hitopk)")
    parser.add_argument("--train-rate", default="1gbit", help="link rate of the training runs (default: %(default)s)")
    parser.add_argument("--target", type=float, default=0.95, help="held-out accuracy to reach (default: %(default)s)")
    parser.add_argument("--skip-bench", action="store_true", help="only the training runs")
    parser.add_argument("--report", metavar="JSON", help="print the tables of an earlier --out file; run nothing")
    parser.add_argument("--sweep", choices=["nodes"],
                        help="nodes: every algorithm at 2-16 hosts x 1 rank and 2-8 hosts x 2 (see above)")
    parser.add_argument("--plot", metavar="PNG", help="draw time against node count, measured and modelled (--sweep nodes)")
    tta = parser.add_argument_group("time to accuracy (--time-to-accuracy)")
    tta.add_argument("--time-to-accuracy", action="store_true",
                     help="train --workload with each --tta-algorithms on every layout and --tta-rates instead of the sweep")
    tta.add_argument("--tta-algorithms", type=comma_list(str, ALGORITHMS.__contains__, f"one of {', '.join(ALGORITHMS)}"),
                     default=["dense", "hier_dense", "topka", "gtopk", "hitopk"], help="(default: %(default)s)")
    tta.add_argument("--tta-rates", type=comma_list(str, emucluster.RATE.match, "a tc rate such as 100mbit"),
                     default=["100mbit", "1gbit"], help="(default: %(default)s)")
    tta.add_argument("--workload", default=WORKLOAD, help="train.py flags of the workload (default: %(default)s)")
    tta.add_argument("--traces", metavar="DIR", help="keep each run's trace here (for analyze.py --plot)")
    tta.add_argument("--tta-repeat", type=positive_int, default=1,
                     help="runs of every cell, the algorithms interleaved; the table shows the median (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.sweep == "nodes":
        parser.set_defaults(**NODE_SWEEP)
        args = parser.parse_args(argv)
    unknown = set(args.train) - set(ALGORITHMS)
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(sorted(unknown))}")
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path and unwritable(path, flag):
            parser.error(unwritable(path, flag))
    return args


def main() -> int:
    args = parse_args()
    if args.report:
        try:
            report(read_sweep(args.report), args.plot)
        except BadFileError as error:
            print(f"bench_cluster.py: error: --report {error}", file=sys.stderr)
            return 2
        return 0
    reason = emucluster.available()
    if reason:
        print(f"bench_cluster.py: error: {reason}", file=sys.stderr)
        return 2
    fields = {**vars(args), "layouts": [f"{h}x{r}" for h, r in args.layouts]}
    document = {"meta": meta("bench_cluster", **fields), "records": [], "training": [], "time_to_accuracy": []}
    sweep = settings_from(args, ClusterSweep)

    def progress(line: str) -> None:
        print(line, flush=True)

    def save() -> None:
        if args.out:
            write_json(args.out, document)

    if args.time_to_accuracy:
        time_to_accuracy_sweep(DRIVERS, sweep, document, progress, save)
        report(document)
        return 0
    bench_sweep(DRIVERS, sweep, document, progress, save)
    report(document, args.plot)
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
