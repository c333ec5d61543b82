#!/usr/bin/env python3
"""Predict each allreduce algorithm's time per step on a cluster you do not have.

The cost model (spar_comm.costmodel) prices every step of every algorithm
with alpha-beta-gamma terms: latency and bandwidth inside and between nodes
(the ranks of a node share its network link), memory passes, and selection
time per element. ``adasum`` is priced but never marked fastest: it changes
the update, not only its cost. Without --calibration the figures are those of --preset
(a GPU cluster by default) and both link speeds must be given; with it they
come from the file(s) and the link flags, when given, override the fitted links.

    predict.py --nodes 16 --ranks-per-node 8 --inter-gbps 25 --intra-gbps 1200 --size 25.6M --density 0.001
    predict.py --nodes 16 --ranks-per-node 8 --inter-gbps 25 --intra-gbps 1200 --size 25.6M \\
        --sweep density --plot density.png
    predict.py --nodes 2 --ranks-per-node 2 --size 4M --calibration calibration.json --json

Fit a calibration to bench_comm.py (and bench_topk.py) output; --holdout-sizes
leaves those sizes out of the fit and reports the model's error on them:

    predict.py fit comm.json topk.json --out calibration.json --holdout-sizes 131072,2097152
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from typing import List, Optional, Tuple

from spar_comm import costmodel
from spar_comm.cli import density, positive_float, positive_int
from spar_comm.collectives.codecs import INDICES, VALUES
from spar_comm.costmodel import CalibrationError, Machine
from spar_comm.costmodel.forecast import SWEEPS, Scenario, plot, point_table, run_sweep, sweep_table, times
from spar_comm.costmodel.holdout import fit_files
from spar_comm.errors import ConfigError
from spar_comm.kernels import SELECTORS

SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}


# -- argument types: each refuses bad input with a clear message (exit status 2) --------
def count(text: str) -> int:
    """An element count such as 1048576, 25.6M or 1.5B (k, M, G/B: powers of ten)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)(?:e(\d+))?\s*([kKmMgGbB]?)\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected a positive element count such as 1048576 or 25.6M, got {text!r}")
    value = float(match.group(1)) * 10 ** int(match.group(2) or 0) * SUFFIXES[match.group(3).lower()]
    if value < 1 or value != int(value):
        raise argparse.ArgumentTypeError(f"a size must be a whole number of elements >= 1, got {text!r}")
    return int(value)


def counts(text: str) -> List[int]:
    return [count(part) for part in text.split(",") if part.strip()] or [count(text)]


def machine_of(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Machine:
    if args.calibration:
        try:
            machine = costmodel.load(args.calibration, base=costmodel.PRESETS[args.preset])
        except CalibrationError as error:
            parser.error(f"--calibration: {error}")
    else:
        if args.inter_gbps is None or args.intra_gbps is None:
            parser.error("--inter-gbps and --intra-gbps are required without --calibration")
        machine = costmodel.PRESETS[args.preset]
    if args.inter_latency_us is not None:
        machine = machine.replace(alpha_inter=args.inter_latency_us * 1e-6)
    if args.intra_latency_us is not None:
        machine = machine.replace(alpha_intra=args.intra_latency_us * 1e-6)
    machine = machine.with_links(args.inter_gbps, args.intra_gbps)
    if args.selector not in machine.select:
        parser.error(f"--selector {args.selector}: the calibration has no selection figure for it")
    return machine


def parse_predict(argv: Optional[List[str]]) -> Tuple[argparse.Namespace, Scenario, Machine]:
    parser = argparse.ArgumentParser(prog="predict.py", description=__doc__.split("\n\n")[0],
                                     epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=positive_int, required=True, help="number of nodes")
    parser.add_argument("--ranks-per-node", type=positive_int, required=True, help="ranks (GPUs) per node")
    parser.add_argument("--cores", type=positive_int,
                        help="the cores all ranks share, on an emulated cluster (as algorithm='auto' counts them "
                             "where ranks outnumber cores): CPU work is stretched by ranks / cores")
    parser.add_argument("--inter-gbps", type=positive_float, help="network link of a node, Gbit/s")
    parser.add_argument("--intra-gbps", type=positive_float, help="rank-to-rank bandwidth inside a node, Gbit/s")
    parser.add_argument("--inter-latency-us", type=positive_float, help="override the inter-node latency (µs)")
    parser.add_argument("--intra-latency-us", type=positive_float, help="override the intra-node latency (µs)")
    parser.add_argument("--size", type=count, required=True, help="gradient elements, e.g. 25.6M, 340M, 1.5B")
    parser.add_argument("--density", type=density, default=0.001, help="fraction selected (default: %(default)s)")
    parser.add_argument("--selector", default="mstopk", choices=sorted(SELECTORS), help="default: %(default)s")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--values", choices=VALUES, help="a value codec for the pairs of topka, hitopk, hitopk_leader")
    parser.add_argument("--indices", choices=INDICES, help="an index codec for the same pairs")
    parser.add_argument("--preset", default="gpu", choices=sorted(costmodel.PRESETS),
                        help="figures without --calibration, and those a calibration lacks (default: %(default)s)")
    parser.add_argument("--calibration", nargs="+", metavar="FILE",
                        help="bench_comm.py / bench_topk.py JSON or a calibration from 'predict.py fit'")
    parser.add_argument("--sweep", choices=SWEEPS, help="vary one quantity; print break-even points")
    parser.add_argument("--plot", metavar="PNG", help="with --sweep: write a plot here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.plot and not args.sweep:
        parser.error("--plot needs --sweep")
    scenario = Scenario(args.nodes, args.ranks_per_node, args.cores, args.size, args.density, args.selector, args.dtype,
                        args.values, args.indices)
    return args, scenario, machine_of(args, parser)


def main_predict(argv: Optional[List[str]]) -> int:
    args, scenario, machine = parse_predict(argv)
    if args.sweep:
        result = run_sweep(scenario, machine, args.sweep)
        if args.plot:
            plot(scenario, machine, result, args.plot)
        if not args.json:
            print(sweep_table(scenario, machine, result))
            if args.plot:
                print(f"wrote {args.plot}")
    else:
        predicted = times(scenario, machine)
        result = {"algorithms": predicted, "best": costmodel.fastest(predicted)}
        if not args.json:
            print(point_table(scenario, machine, predicted))
    if args.json:
        print(json.dumps({**result, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "size": args.size,
                          "density": args.density, "selector": args.selector, "dtype": args.dtype,
                          "machine": machine.to_dict()}, indent=1))
    return 0


def main_fit(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(prog="predict.py fit",
                                     description="Fit the cost model to bench_comm.py (and bench_topk.py) JSON.")
    parser.add_argument("files", nargs="+", metavar="JSON", help="bench_comm.py and bench_topk.py output")
    parser.add_argument("--holdout-sizes", type=counts, default=[],
                        help="comma-separated sizes left out of the fit; the model is scored on them")
    parser.add_argument("--base", default="cpu", choices=sorted(costmodel.PRESETS),
                        help="figures the files cannot determine (default: %(default)s)")
    parser.add_argument("--out", metavar="FILE", help="write the calibration here")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    try:
        fitted = fit_files(args.files, args.holdout_sizes, costmodel.PRESETS[args.base])
    except (CalibrationError, ConfigError) as error:
        parser.error(str(error))
    if args.out:
        costmodel.save(args.out, fitted.machine, args.files, [row for row, *_ in fitted.fitted])
    if args.json:
        print(json.dumps(fitted.summary(), indent=1))
        return 0
    print(fitted.report())
    if args.out:
        print(f"wrote {args.out}")
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return main_fit(argv[1:]) if argv[:1] == ["fit"] else main_predict(argv)


if __name__ == "__main__":
    sys.exit(main())
