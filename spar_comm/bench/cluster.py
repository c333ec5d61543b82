"""The report of drivers/bench_cluster.py's sweeps: the tables of times per
cell, the cost model fitted on some cells and checked on the held-out ones,
CPU contention, bytes on the links and time to accuracy; and the check of
an earlier --out file. Apart from the runs themselves, so that a sweep's
file can be read again and tested without a cluster."""
from __future__ import annotations

import itertools
import statistics
from typing import Callable, Optional

import numpy as np

from .. import costmodel, emucluster
from ..collectives import ALGORITHMS
from ..costmodel.calibrate import LARGEST_CLUSTER, LARGEST_SIZE, measurable
from ..files import BadFileError, Nullable, check, read_json
from ..kernels import SELECTORS

#: The dense algorithms: a sweep runs them at its first density only, whose time holds for all.
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


def held_out_rule(document: dict) -> Callable[[dict], bool]:
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
    errors = [c["error"] for c in checked]
    if errors:
        lines.append(f"median error {statistics.median(errors):.0%} over {len(errors)} held-out cells")
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


