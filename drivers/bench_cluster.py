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
import itertools
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from spar_comm import ALGORITHMS, costmodel, emucluster
from spar_comm.cli import comma_list, positive_int
from spar_comm.costmodel.calibrate import LARGEST_CLUSTER, LARGEST_SIZE, measurable
from spar_comm.files import BadFileError, Nullable, check, read_json, write_json
from spar_comm.kernels import SELECTORS
from spar_comm.training.trace import read_trace

HERE = Path(__file__).resolve().parent
#: The communication-bound workload: the digits MLP with two hidden layers of
#: 1024 (1,126,410 parameters), 10 epochs, density 0.001 for the sparse ones.
WORKLOAD = "--hidden 1024 --epochs 10 --density 0.001"
DENSE = ("dense", "hier_dense")
#: --sweep nodes: time against the node count (flags given explicitly still win).
NODE_SWEEP = dict(layouts=[(2, 1), (4, 1), (8, 1), (16, 1), (2, 2), (4, 2), (8, 2)], sizes=[1 << 20, 1 << 22],
                  densities=[0.001], rates=["100mbit", "1gbit", emucluster.UNSHAPED], train=[], repeat=5)
#: The node sweep's model is fitted on cells of at most this many hosts and asked for the others.
FIT_HOSTS = 4
#: What --report reads of an --out file (spar_comm.files.check); "training" may be absent.
#: A record's "cores" (the cores every emulated host shared) may be absent: older files.
SWEEP = {"records": [{"layout": str, "hosts": int, "ranks_per_host": int, "rate": str, "rate_bps": Nullable(float),
                      "density": float, "selector": str, "algorithm": str, "size": int, "time_median": float,
                      "t_select": float}]}
TRAINING = [{"algorithm": str, "layout": str, "rate": str, "target": float, "seconds_to_target": Nullable(float),
             "epoch_to_target": Nullable(int), "final_metric": float, "total_seconds": float}]


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
        if path and not os.access(os.path.dirname(os.path.abspath(path)), os.W_OK):
            parser.error(f"cannot write {flag} {path}")
    return args


def run_bench_comm(spec, args, density: float, algorithms: list, repeat: int) -> dict:
    """bench_comm.py across the emulated hosts; returns its JSON document."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bench.json")
        command = [sys.executable, str(HERE / "bench_comm.py"), "--sizes", ",".join(map(str, args.sizes)),
                   "--density", str(density), "--algorithms", ",".join(algorithms),
                   "--repeat", str(repeat), "--warmup", str(args.warmup), "--out", out,
                   "--link-counters", emucluster.IFACE]
        if args.selector:
            command += ["--selector", args.selector]
        result = emucluster.run(spec, command, timeout=args.limit)
        if result.returncode != 0:
            raise RuntimeError(f"bench_comm failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return json.loads(Path(out).read_text())


def time_to_accuracy(spec, algorithm: str, target: float, limit: float, workload: Sequence[str] = (),
                     keep: Optional[str] = None) -> dict:
    """A training run (train.py's defaults, or ``workload``'s flags) across the
    emulated hosts: wall seconds and epochs until the held-out accuracy first
    reaches ``target``, the final accuracy and the bytes sent between nodes,
    from the run's trace (kept at ``keep`` when given)."""
    with tempfile.TemporaryDirectory() as folder:
        trace_path = keep or os.path.join(folder, "train.h5")
        command = [sys.executable, str(HERE / "train.py"), *workload, "--algorithm", algorithm, "--ranks-per-node", "0",
                   "--trace", trace_path, "--no-progress"]
        result = emucluster.run(spec, command, timeout=limit)
        if result.returncode != 0:
            raise RuntimeError(f"train.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return {"algorithm": algorithm, **trace_figures(read_trace(trace_path).data, target),
                "summary": result.stdout.strip().splitlines()[-1]}


def trace_figures(evals: dict, target: float) -> dict:
    """Time to ``target`` from a run's trace: as measured (``seconds_to_target``)
    and as steps to the target times the median step (slowest rank), which a
    spell of load from other work on the machine hardly moves."""
    reached = [i for i, metric in enumerate(evals["eval/test_metric"]) if metric >= target]
    median_step = float(np.median(evals["phases/step"].max(axis=1)))
    return {
        "target": target,
        "seconds_to_target": float(evals["eval/wall"][reached[0]]) if reached else None,
        "epoch_to_target": int(evals["eval/epoch"][reached[0]]) if reached else None,
        "steps_to_target": int(evals["eval/step"][reached[0]]) if reached else None,
        "median_step_seconds": median_step,
        "final_metric": float(evals["eval/test_metric"][-1]),
        "total_seconds": float(evals["eval/wall"][-1]),
        "epochs": float(evals["eval/epoch"][-1]),
        "bytes_inter": int(evals["bytes/inter"].sum()),
    }


def time_to_accuracy_sweep(args: argparse.Namespace, document: dict) -> None:
    """--time-to-accuracy: the workload with every algorithm, layout and rate;
    the document is written after every run."""
    workload = args.workload.split()
    if args.traces:
        os.makedirs(args.traces, exist_ok=True)
    for hosts, ranks in args.layouts:
        emucluster.down(args.prefix)
        spec = emucluster.up(emucluster.ClusterSpec(hosts, ranks, args.tta_rates[0], "0us", args.prefix))
        try:
            for rate in args.tta_rates:
                spec = emucluster.reshape(spec, rate, "0us")
                for repeat, algorithm in itertools.product(range(args.tta_repeat), args.tta_algorithms):
                    print(f"# time to accuracy: {algorithm} on {hosts}x{ranks} at {rate}, run {repeat + 1}", flush=True)
                    name = f"{algorithm}-{hosts}x{ranks}-{rate}-{repeat}.h5"
                    keep = os.path.join(args.traces, name) if args.traces else None
                    run = time_to_accuracy(spec, algorithm, args.target, args.limit, workload, keep)
                    document["time_to_accuracy"].append({"layout": f"{hosts}x{ranks}", "rate": rate, "repeat": repeat,
                                                         "workload": args.workload, "trace": keep, **run})
                    if args.out:
                        write_json(args.out, document)
        finally:
            emucluster.down(args.prefix)


def tta_table(runs: list) -> str:
    """One row per cell (layout, rate, algorithm): median time to the target over
    its runs (training is bit-deterministic, so only the times vary), measured
    and estimated from the median step (``trace_figures``), each with its
    speed-up over dense in the same layout and rate; epochs to the target,
    final accuracy and bytes between nodes."""
    cells: dict = {}
    for run in runs:
        cells.setdefault((run["layout"], run["rate"], run["algorithm"]), []).append(run)

    def median(values: list) -> Optional[float]:
        return None if not values or None in values else float(statistics.median(values))

    def estimate(run: dict) -> Optional[float]:
        steps = run["steps_to_target"]
        return None if steps is None else steps * run["median_step_seconds"]

    def speedup(seconds: Optional[float], base: Optional[float]) -> str:
        return f"{base / seconds:7.2f}x" if seconds and base else f"{'-':>8}"

    lines = [f"{'layout':>6} {'rate':>8} {'algorithm':<11} {'s to target':>11} {'vs dense':>8} {'est. s':>7} "
             f"{'vs dense':>8} {'epochs':>6} {'final acc':>9} {'total s':>8} {'inter MB':>9} {'runs':>4}"]
    for (layout, rate, algorithm), group in cells.items():
        dense = cells.get((layout, rate, "dense"), [])
        seconds, base = (median([r["seconds_to_target"] for r in runs]) for runs in (group, dense))
        estimated, base_estimate = (median([estimate(r) for r in runs]) for runs in (group, dense))
        first = group[0]
        lines.append(f"{layout:>6} {rate:>8} {algorithm:<11} "
                     f"{f'{seconds:.2f}' if seconds is not None else 'never':>11} {speedup(seconds, base)} "
                     f"{f'{estimated:.2f}' if estimated is not None else 'never':>7} {speedup(estimated, base_estimate)} "
                     f"{first['epoch_to_target'] if seconds is not None else '-':>6} "
                     f"{first['final_metric']:9.4f} {median([r['total_seconds'] for r in group]):8.2f} "
                     f"{first['bytes_inter'] / 1e6:9.1f} {len(group):>4}")
    return "\n".join(lines)


def measurement(r: dict) -> costmodel.Measurement:
    """A cell as the cost model sees it: every emulated host on this machine's cores."""
    cluster = costmodel.Cluster(r["hosts"], r["ranks_per_host"], r.get("cores"))
    return costmodel.Measurement(cluster, r["algorithm"], r["size"], "float32", r["density"], r["selector"],
                                 r["time_median"], r["t_select"])


def held_out_rule(document: dict):
    """Which cells the model must predict without having seen them: the 8- and
    16-host cells of a node sweep, the larger sizes of the other sweeps."""
    records = document["records"]
    if document.get("meta", {}).get("sweep") == "nodes":
        return lambda r: r["hosts"] > FIT_HOSTS
    smallest = min(r["size"] for r in records)
    return lambda r: r["size"] > smallest


def shaped_rates(records: list) -> list:
    """The link rates of the records, slowest first, unshaped links left out."""
    return sorted({r["rate"] for r in records if r["rate"] != emucluster.UNSHAPED}, key=emucluster.rate_bits_per_second)


def fitted_models(records: list, held_out) -> dict:
    """Per shaped link rate, the cost model fitted on the cells ``held_out`` rejects."""
    fitted = {rate: [measurement(r) for r in records if r["rate"] == rate and not held_out(r)]
              for rate in shaped_rates(records)}
    return {rate: costmodel.fit(rows) for rate, rows in fitted.items() if rows}


def model_check(records: list, held_out, models: dict) -> list:
    """The cost model against the held-out cells (``models``: per rate, fitted on the others)."""
    checked = []
    for rate, machine in models.items():
        for r in records:
            if r["rate"] == rate and held_out(r):
                predicted = machine.seconds(measurement(r).terms())
                checked.append({"layout": r["layout"], "rate": rate, "size": r["size"], "density": r["density"],
                                "algorithm": r["algorithm"], "measured": r["time_median"], "predicted": predicted,
                                "error": abs(predicted - r["time_median"]) / r["time_median"]})
    return checked


def model_table(checked: list) -> str:
    lines = [f"{'layout':>6} {'rate':>8} {'size':>9} {'density':>7} {'algorithm':<14} {'measured':>9} "
             f"{'predicted':>9} {'error':>6}   (ms; model fitted per rate on the other cells)"]
    for c in checked:
        lines.append(f"{c['layout']:>6} {c['rate']:>8} {c['size']:>9} {c['density']:>7} {c['algorithm']:<14} "
                     f"{c['measured'] * 1e3:9.1f} {c['predicted'] * 1e3:9.1f} {c['error']:6.0%}")
    errors = sorted(c["error"] for c in checked)
    if errors:
        lines.append(f"median error {errors[len(errors) // 2]:.0%} over {len(errors)} held-out cells")
    for algorithm in ALGORITHMS:
        mine = sorted(c["error"] for c in checked if c["algorithm"] == algorithm)
        if mine:
            lines.append(f"  {algorithm:<14} median {statistics.median(mine):5.0%}, worst {mine[-1]:5.0%} "
                         f"over {len(mine)} cells")
    return "\n".join(lines)


def contention_table(records: list) -> str:
    """What share of each shaped cell's time the same call takes on unshaped
    links, where only the CPU (ranks sharing this machine's cores, TCP, MPI's
    progress polling) is left: an upper bound on the part of a time that is
    not the links'."""
    unshaped = {(r["layout"], r["size"], r["density"], r["algorithm"]): r["time_median"]
                for r in records if r["rate"] == emucluster.UNSHAPED}
    rates = shaped_rates(records)
    lines = [f"{'layout':>6} {'size':>9} {'algorithm':<14} {'unshaped':>9} " + " ".join(f"{rate:>9}" for rate in rates)
             + "   (unshaped ms, and as a share of the time at each rate)"]
    for key, seconds in unshaped.items():
        shares = []
        for rate in rates:
            match = [r for r in records if r["rate"] == rate and (r["layout"], r["size"], r["density"], r["algorithm"]) == key]
            shares.append(f"{seconds / match[0]['time_median']:9.0%}" if match else f"{'-':>9}")
        lines.append(f"{key[0]:>6} {key[1]:>9} {key[3]:<14} {seconds * 1e3:9.1f} " + " ".join(shares))
    return "\n".join(lines)


def bytes_table(records: list) -> str:
    """Bytes between nodes per call: counted on the links (every host's sent
    bytes, TCP headers and acknowledgements included) against what the
    package counts (every rank's ``bytes_inter``)."""
    lines = [f"{'layout':>6} {'size':>9} {'algorithm':<14} {'links MB':>9} {'package MB':>10} {'ratio':>6}"]
    seen = set()
    for r in records:
        key = (r["layout"], r["size"], r["density"], r["algorithm"])
        if "link_bytes" not in r or key in seen:
            continue
        seen.add(key)
        counted = r.get("bytes_inter_all_ranks", 0)
        ratio = f"{r['link_bytes'] / counted:6.2f}" if counted else f"{'-':>6}"
        lines.append(f"{r['layout']:>6} {r['size']:>9} {r['algorithm']:<14} {r['link_bytes'] / 1e6:9.3f} "
                     f"{counted / 1e6:10.3f} {ratio}")
    return "\n".join(lines)


def plot_nodes(records: list, models: dict, path: str) -> None:
    """Time per call against the node count, one panel per link rate and ranks
    per host at the largest size: measured points, and ``models`` (per rate,
    fitted on the cells of at most FIT_HOSTS hosts) as lines, dashed where
    they extrapolate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = max(r["size"] for r in records)
    rates = list(models)
    per_host = sorted({r["ranks_per_host"] for r in records})
    fig, grid = plt.subplots(len(per_host), len(rates), figsize=(5 * len(rates), 3.6 * len(per_host)),
                             squeeze=False, sharey=True)
    for axes, (ranks, rate) in zip(grid.flat, itertools.product(per_host, rates)):
        for number, algorithm in enumerate(ALGORITHMS):
            cells = sorted((r for r in records
                            if (r["rate"], r["ranks_per_host"], r["size"], r["algorithm"]) == (rate, ranks, size, algorithm)),
                           key=lambda r: r["hosts"])
            if not cells:
                continue
            color = f"C{number}"
            hosts = [r["hosts"] for r in cells]
            axes.plot(hosts, [1e3 * r["time_median"] for r in cells], "o", color=color, label=algorithm)
            predicted = [1e3 * models[rate].seconds(measurement(r).terms()) for r in cells]
            fitted = [h for h in hosts if h <= FIT_HOSTS]
            axes.plot(hosts[:len(fitted)], predicted[:len(fitted)], "-", color=color, linewidth=1)
            axes.plot(hosts[len(fitted) - 1:], predicted[len(fitted) - 1:], "--", color=color, linewidth=1)
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_title(f"{rate}, {ranks} rank{'s' if ranks > 1 else ''} per host, {size:,} floats", fontsize=9)
        axes.set_xlabel("hosts (nodes)")
    for row in grid:
        row[0].set_ylabel("ms per allreduce (slowest rank)")
    grid[0][-1].legend(fontsize=7)
    fig.suptitle(f"points: measured; lines: cost model fitted on <= {FIT_HOSTS} hosts (dashed: predicted)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_sweep(path: str) -> dict:
    """An earlier --out file, checked: BadFileError names the file and what is wrong."""
    document = check(read_json(path), SWEEP, path)
    check(document.get("training", []), TRAINING, path, "training")
    for i, r in enumerate(document["records"]):
        if (r["algorithm"] not in ALGORITHMS or r["selector"] not in SELECTORS
                or not emucluster.RATE.match(r["rate"]) or min(r["hosts"], r["ranks_per_host"], r["size"]) < 1
                or max(r["hosts"], r["ranks_per_host"]) >= LARGEST_CLUSTER or r["size"] >= LARGEST_SIZE
                or not 0 < r["density"] <= 1 or not measurable(r["time_median"])
                or not measurable(r["t_select"], zero=True)
                or not (r.get("cores") is None or type(r["cores"]) is int and r["cores"] >= 1)):
            raise BadFileError(path, f"records[{i}] is not a cell this program measures: {r}")
    return document


def report(document: dict, plot: Optional[str] = None) -> None:
    """Print the tables of a sweep: times per cell, the cost model against the
    held-out cells (kept in the document), CPU contention and bytes on the
    links where measured, and the training runs; draw the node plot."""
    records = document["records"]
    if records:
        print(table(records))
        held_out = held_out_rule(document)
        checks = any(map(held_out, records))
        models = fitted_models(records, held_out) if checks or plot else {}
        if checks:
            document["model_check"] = model_check(records, held_out, models)
            print(model_table(document["model_check"]))
        if any(r["rate"] == emucluster.UNSHAPED for r in records):
            print(contention_table(records))
        if any("link_bytes" in r for r in records):
            print(bytes_table(records))
        if plot:
            plot_nodes(records, models, plot)
            print(f"plot: {plot}")
    if document.get("time_to_accuracy"):
        runs = document["time_to_accuracy"]
        print(f"time to {runs[0]['target']:.0%} held-out accuracy, {runs[0]['workload']} "
              f"(inter MB: bytes sent between nodes, all ranks)")
        print(tta_table(runs))
    for run in document.get("training", []):
        reached = (f"{run['seconds_to_target']:.2f} s (epoch {run['epoch_to_target']})"
                   if run["seconds_to_target"] is not None else "never")
        print(f"training {run['algorithm']:<8} on {run['layout']} at {run['rate']}: {run['target']:.0%} held-out "
              f"accuracy after {reached}; final {run['final_metric']:.4f} in {run['total_seconds']:.2f} s")


def table(records: list) -> str:
    algorithms = [a for a in ALGORITHMS if any(r["algorithm"] == a for r in records)]
    keys = sorted({(r["ranks_per_host"], r["hosts"], r["layout"], r["rate"], r["size"], r["density"]) for r in records},
                  key=lambda k: (k[0], emucluster.rate_bits_per_second(k[3]), k[4], k[5], k[1]))
    lines = [f"{'layout':>6} {'rate':>8} {'size':>9} {'density':>7} " + " ".join(f"{a:>13}" for a in algorithms)
             + "   (ms per call, slowest rank)"]
    for _, _, layout, rate, size, density in keys:
        cells = []
        for algorithm in algorithms:
            # dense algorithms ran at the first density only: their time holds for all
            match = [r for r in records if (r["layout"], r["rate"], r["size"], r["algorithm"]) == (layout, rate, size, algorithm)
                     and (r["density"] == density or algorithm in DENSE)]
            cells.append(f"{match[0]['time_median'] * 1e3:13.1f}" if match else f"{'-':>13}")
        lines.append(f"{layout:>6} {rate:>8} {size:>9} {density:>7} " + " ".join(cells))
    return "\n".join(lines)


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
    records, document = [], {"meta": vars(args).copy(), "records": [], "training": [], "time_to_accuracy": []}
    document["meta"]["layouts"] = [f"{h}x{r}" for h, r in args.layouts]
    if args.time_to_accuracy:
        time_to_accuracy_sweep(args, document)
        report(document)
        return 0
    dense = [a for a in args.algorithms if a in DENSE]
    sparse = [a for a in args.algorithms if a not in DENSE]
    runs = [(args.densities[0], dense, args.dense_repeat)] if dense else []  # the density does not matter
    runs += [(density, sparse, args.repeat) for density in args.densities] if sparse else []
    for number, (hosts, ranks) in enumerate(args.layouts):
        emucluster.down(args.prefix)
        spec = emucluster.up(emucluster.ClusterSpec(hosts, ranks, args.rates[0], "0us", args.prefix))
        try:
            for rate in [] if args.skip_bench else args.rates:
                spec = emucluster.reshape(spec, rate, "0us")
                for density, algorithms, repeat in runs:
                    print(f"# {hosts}x{ranks} at {rate}, density {density}: {', '.join(algorithms)}", flush=True)
                    result = run_bench_comm(spec, args, density, algorithms, repeat)
                    for row in result["results"]:
                        records.append({"layout": f"{hosts}x{ranks}", "hosts": hosts, "ranks_per_host": ranks,
                                        "cores": len(os.sched_getaffinity(0)),
                                        "rate": rate, "rate_bps": _finite(emucluster.rate_bits_per_second(rate)),
                                        "density": density, "selector": result["meta"]["selector"], **row})
                    document["records"] = records
                    document["bench_comm_meta"] = result["meta"]
                    if args.out:
                        write_json(args.out, document)
            if number == 0 and args.train:
                spec = emucluster.reshape(spec, args.train_rate, "0us")
                for algorithm in args.train:
                    print(f"# training with {algorithm} on {hosts}x{ranks} at {args.train_rate}", flush=True)
                    run = time_to_accuracy(spec, algorithm, args.target, args.limit)
                    document["training"].append({"layout": f"{hosts}x{ranks}", "rate": args.train_rate, **run})
                    if args.out:
                        write_json(args.out, document)
        finally:
            emucluster.down(args.prefix)
    report(document, args.plot)
    if args.out:
        write_json(args.out, document)
    return 0


def _finite(value: float) -> Optional[float]:
    """JSON has no infinity: an unshaped link's rate is written as null."""
    return value if value < float("inf") else None


if __name__ == "__main__":
    sys.exit(main())
