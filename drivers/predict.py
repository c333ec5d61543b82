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
import math
import re
import sys
from statistics import median
from typing import Dict, List, Optional, Sequence

from spar_comm import costmodel
from spar_comm.cli import density, positive_float, positive_int
from spar_comm.collectives.codecs import INDICES, VALUES
from spar_comm.costmodel import CalibrationError, Cluster, Machine
from spar_comm.costmodel.calibrate import measurements, read
from spar_comm.kernels import SELECTORS

SUFFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "b": 10**9}
SWEEPS = ("density", "size", "nodes")


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


def cluster_of(args: argparse.Namespace, nodes: int) -> Cluster:
    """The priced cluster at ``nodes`` nodes (a sweep varies them)."""
    return Cluster(nodes, args.ranks_per_node, args.cores)


def predict(args: argparse.Namespace, machine: Machine, **override) -> Dict[str, float]:
    point = {"nodes": args.nodes, "size": args.size, "density": args.density, **override}
    cluster = cluster_of(args, point["nodes"])
    return costmodel.predict(cluster, point["size"], machine, args.dtype, point["density"], args.selector,
                             algorithms=list(costmodel.STEPS), values=args.values, indices=args.indices)


def sweep_values(args: argparse.Namespace) -> List[float]:
    if args.sweep == "density":
        return [10 ** (e / 4) for e in range(-20, 1)]  # 1e-5 .. 1, four per decade
    if args.sweep == "size":
        return [2**e for e in range(12, 32)]  # 4 Ki .. 2 Gi elements
    return [2**e for e in range(0, 11)]  # 1 .. 1024 nodes


def break_even(args: argparse.Namespace, machine: Machine, values: Sequence[float], bests: Sequence[str]) -> List[dict]:
    """Where the fastest algorithm changes: bisected between grid points (in log
    space; node counts to the integer)."""
    found = []
    for lo, hi, before, after in zip(values, values[1:], bests, bests[1:]):
        if before == after:
            continue
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            if args.sweep != "density":
                mid = int(round(mid))
                if mid in (lo, hi):
                    break
            if costmodel.fastest(predict(args, machine, **{args.sweep: mid})) == before:
                lo = mid
            else:
                hi = mid
        found.append({"value": hi, "from": before, "to": after})
    return found


def show_value(sweep: str, value: float) -> str:
    return f"{value:.3g}" if sweep == "density" else f"{int(value):,}"


def run_sweep(args, machine: Machine) -> dict:
    values = sweep_values(args)
    points = [predict(args, machine, **{args.sweep: v}) for v in values]
    bests = [costmodel.fastest(p) for p in points]
    crossings = break_even(args, machine, values, bests)
    if args.plot:
        plot(args, values, points, crossings)
    return {"sweep": args.sweep, "points": [{"value": v, "algorithms": p, "best": b}
                                            for v, p, b in zip(values, points, bests)], "break_even": crossings}


def plot(args, values: Sequence[float], points: Sequence[Dict[str, float]], crossings: Sequence[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name in points[0]:
        ax.plot(values, [p[name] * 1e3 for p in points], marker=".", label=name)
    for c in crossings:
        ax.axvline(c["value"], color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"→ {c['to']}", (c["value"], 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8, color="dimgrey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    unit = {"density": "density (k / n)", "size": "gradient size (elements)", "nodes": "nodes"}[args.sweep]
    ax.set_xlabel(unit)
    ax.set_ylabel("predicted time per allreduce (ms)")
    ax.set_title(title(args), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    plt.close(fig)


def title(args) -> str:
    parts = {
        "nodes": f"{args.nodes} nodes x {args.ranks_per_node}" if args.sweep != "nodes" else f"nodes x {args.ranks_per_node}",
        "size": f"{args.size:,} elements" if args.sweep != "size" else None,
        "density": f"density {args.density:g}" if args.sweep != "density" else None,
    }
    links = f"inter {args.links[0]:.4g} Gbit/s, intra {args.links[1]:.4g} Gbit/s"
    codecs = "".join(f", {name} {kind}" for kind, name in (("values", args.values), ("indices", args.indices)) if name)
    cores = f"; {args.cores} cores shared" if args.cores else ""
    return ", ".join(p for p in parts.values() if p) + f", {args.dtype}, {args.selector}{codecs}; {links}{cores}"


def print_point(args, machine: Machine, times: Dict[str, float]) -> None:
    best = costmodel.fastest(times)
    print(f"# {title(args)}")
    print(f"{'algorithm':<14} {'ms/step':>10} {'vs dense':>8} {'select':>8} {'intra':>8} {'inter':>8} {'local':>8}")
    cluster = cluster_of(args, args.nodes)
    for name, seconds in times.items():
        parts = costmodel.breakdown(name, cluster, args.size, machine, args.dtype, args.density, args.selector,
                                    values=args.values, indices=args.indices)
        cells = " ".join(f"{parts[p] * 1e3:8.3f}" for p in ("select", "intra", "inter", "local"))
        mark = "  <- fastest" if name == best else ""
        print(f"{name:<14} {seconds * 1e3:10.3f} {times['dense'] / seconds:7.2f}x {cells}{mark}")


def print_sweep(args, result: dict) -> None:
    names = list(result["points"][0]["algorithms"])
    print(f"# sweep of {args.sweep}: {title(args)}; ms per step")
    print(f"{args.sweep:>14} " + " ".join(f"{n:>13}" for n in names) + "  fastest")
    for point in result["points"]:
        cells = " ".join(f"{point['algorithms'][n] * 1e3:13.3f}" for n in names)
        print(f"{show_value(args.sweep, point['value']):>14} {cells}  {point['best']}")
    print("break-even points:" if result["break_even"] else "break-even points: none (one algorithm is fastest throughout)")
    for c in result["break_even"]:
        print(f"  {args.sweep} {show_value(args.sweep, c['value'])}: {c['from']} -> {c['to']}")
    if args.plot:
        print(f"wrote {args.plot}")


def parse_predict(argv: Optional[List[str]]) -> tuple:
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
    machine = machine_of(args, parser)
    args.links = (costmodel.beta_to_gbps(machine.beta_inter), costmodel.beta_to_gbps(machine.beta_intra))
    return args, machine


def main_predict(argv: Optional[List[str]]) -> int:
    args, machine = parse_predict(argv)
    if args.sweep:
        result = run_sweep(args, machine)
        if not args.json:
            print_sweep(args, result)
    else:
        times = predict(args, machine)
        result = {"algorithms": times, "best": costmodel.fastest(times)}
        if not args.json:
            print_point(args, machine, times)
    if args.json:
        print(json.dumps({**result, "nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "size": args.size,
                          "density": args.density, "selector": args.selector, "dtype": args.dtype,
                          "machine": machine.to_dict()}, indent=1))
    return 0


# -- fitting ---------------------------------------------------------------------------
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
    rows, rates = [], {}
    try:
        for path in args.files:
            kind, document = read(path)
            if kind == "bench_comm":
                rows.extend(measurements(document, path))
            elif kind == "bench_topk":
                rates.update(costmodel.calibrate.topk_rates(document, path))
            else:
                parser.error(f"{path} is already a calibration; fit reads bench_comm.py/bench_topk.py output")
        fitted_rows = [r for r in rows if r.size not in args.holdout_sizes]
        held_rows = [r for r in rows if r.size in args.holdout_sizes]
        if not fitted_rows:
            parser.error("no bench_comm rows left to fit (give bench_comm.py output; check --holdout-sizes)")
        if args.holdout_sizes and not held_rows:
            parser.error("no bench_comm rows at the --holdout-sizes")
        machine = costmodel.fit(fitted_rows, costmodel.PRESETS[args.base], rates)
    except CalibrationError as error:
        parser.error(str(error))
    fitted = costmodel.relative_errors(machine, fitted_rows)
    held = costmodel.relative_errors(machine, held_rows)
    if args.out:
        costmodel.save(args.out, machine, args.files, fitted_rows)
    summary = {
        "machine": machine.to_dict(),
        "fit_sizes": sorted({r.size for r in fitted_rows}),
        "holdout_sizes": sorted({r.size for r in held_rows}),
        "fit_median_relative_error": median(e for *_, e in fitted),
        "holdout_median_relative_error": median(e for *_, e in held) if held else None,
        "holdout": [{"algorithm": r.algorithm, "size": r.size, "measured_s": r.seconds, "predicted_s": p,
                     "relative_error": e} for r, p, e in held],
    }
    if args.json:
        print(json.dumps(summary, indent=1))
        return 0
    print_figures(machine)
    print(f"fitted on {len(fitted_rows)} rows at sizes {', '.join(map(str, summary['fit_sizes']))}: "
          f"median |pred-meas|/meas {summary['fit_median_relative_error']:.1%}")
    if held:
        print(f"{'size':>10} {'algorithm':<14} {'measured ms':>11} {'predicted ms':>12} {'error':>7}")
        for r, p, e in held:
            print(f"{r.size:>10} {r.algorithm:<14} {r.seconds * 1e3:11.3f} {p * 1e3:12.3f} {e:7.1%}")
        print(f"held-out sizes {', '.join(map(str, summary['holdout_sizes']))}: "
              f"median |pred-meas|/meas {summary['holdout_median_relative_error']:.1%} over {len(held)} rows")
    if args.out:
        print(f"wrote {args.out}")
    return 0


def print_figures(machine: Machine) -> None:
    print(f"overhead {machine.overhead * 1e6:.1f} µs per call; memory pass {machine.gamma * 1e12:.1f} ps/byte")
    print(f"intra: alpha {machine.alpha_intra * 1e6:.1f} µs, {costmodel.beta_to_gbps(machine.beta_intra):.3g} Gbit/s; "
          f"inter: alpha {machine.alpha_inter * 1e6:.1f} µs, {costmodel.beta_to_gbps(machine.beta_inter):.3g} Gbit/s")
    print("selection: " + ", ".join(f"{name} {call * 1e6:.0f} µs + {element * 1e9:.3g} ns/element"
                                    for name, (call, element) in sorted(machine.select.items())))


def main(argv: Optional[List[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return main_fit(argv[1:]) if argv[:1] == ["fit"] else main_predict(argv)


if __name__ == "__main__":
    sys.exit(main())
