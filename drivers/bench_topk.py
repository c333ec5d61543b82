#!/usr/bin/env python3
"""Benchmark the top-k selectors of spar_comm.kernels against their baselines.

For every size n and density d (k = max(1, round(d * n))) on Gaussian data it
times, as the median of --repeat runs after one warm-up run:

* every selected method of ``spar_comm.kernels`` (default: all registered);
* ``numpy.argpartition`` of ``|x|``, the usual exact baseline;
* ``torch.topk`` of ``|x|``, when torch can be imported;
* the floor: one read pass over the same data, ``np.abs(x).max()``.

It prints one table row per (n, d, method) with the speed-up over
argpartition, the multiple of the floor, and the recall against the exact
top-k set, and writes every figure as JSON (``--out``) for the cost model:
``{"machine": {...}, "records": [{"n", "k", "density", "dtype", "method",
"median_s", ...}, ...]}``. Stateful methods (``*_warm``) see the same array
on every run, i.e. their best case of a gradient that did not change.

Example:
    python drivers/bench_topk.py --sizes 1048576,16777216 --densities 0.001,0.01 --out topk.json
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import sys
import time
from typing import Callable, Dict, List, Optional

import numpy as np

from spar_comm.cli import comma_list, positive_int
from spar_comm.kernels import SELECTORS, make_selector
from spar_comm.kernels.selection import exact_topk

BASELINES = ("argpartition", "torch.topk", "floor")


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--sizes", type=comma_list(int, lambda v: v >= 1, "an integer >= 1"),
        default=[1 << 20, 1 << 22, 1 << 24], help="comma-separated array lengths (default: 2^20,2^22,2^24)",
    )
    parser.add_argument(
        "--densities", type=comma_list(float, lambda v: 0 < v <= 1, "in (0, 1]"),
        default=[0.001, 0.01], help="comma-separated k/n ratios (default: 0.001,0.01)",
    )
    parser.add_argument(
        "--methods", type=comma_list(str, lambda m: m in SELECTORS, f"one of {', '.join(sorted(SELECTORS))}"),
        default=sorted(SELECTORS), help=f"comma-separated selector methods (default: all: {','.join(sorted(SELECTORS))})",
    )
    parser.add_argument("--repeat", type=positive_int, default=7, help="timed runs per figure, after one warm-up (default: 7)")
    parser.add_argument("--dtype", choices=["float16", "float32", "float64"], default="float32", help="element type (default: float32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the Gaussian test data (default: 0)")
    parser.add_argument("--out", metavar="FILE.json", help="write the records and machine metadata here as JSON")
    parser.add_argument("--no-torch", action="store_true", help="leave torch.topk out even when torch is installed")
    args = parser.parse_args(argv)
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        parser.error(f"--out: the folder of {args.out!r} does not exist")
    return args


def median_time(run: Callable[[], object], repeat: int) -> tuple[float, float]:
    """(median, min) seconds of ``repeat`` runs after one warm-up run."""
    run()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), float(min(times))


def load_torch(wanted: bool):
    if not wanted:
        return None
    try:
        import torch
    except ImportError:
        return None
    return torch


def machine() -> Dict[str, object]:
    """What a reader needs to compare figures between machines."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    info: Dict[str, object] = {
        "host": socket.gethostname(),
        "cpu": cpu,
        "cpus": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    for module in ("numba", "torch"):
        try:
            info[module] = __import__(module).__version__
        except ImportError:
            info[module] = None
    return info


def bench(args: argparse.Namespace) -> List[Dict[str, object]]:
    torch = load_torch(not args.no_torch)
    rng = np.random.default_rng(args.seed)
    records: List[Dict[str, object]] = []
    for n in args.sizes:
        x = rng.standard_normal(n, dtype=np.float32).astype(args.dtype)
        floor, floor_min = median_time(lambda: np.abs(x).max(), args.repeat)
        for density in args.densities:
            k = max(1, min(n, round(density * n)))
            truth = exact_topk(x, k)
            runs: Dict[str, Callable[[], object]] = {
                "argpartition": lambda: np.argpartition(np.abs(x), n - k),
            }
            if torch is not None:
                t = torch.from_numpy(x)
                runs["torch.topk"] = lambda: torch.topk(t.abs(), k, sorted=False)
            for method in args.methods:
                selector = make_selector(method)
                runs[method] = lambda s=selector: s(x, k)
            times = {name: median_time(run, args.repeat) for name, run in runs.items()}
            times["floor"] = (floor, floor_min)
            for name, (med, best) in times.items():
                recall = None
                if name in SELECTORS:
                    recall = np.intersect1d(runs[name](), truth, assume_unique=True).size / truth.size
                records.append({
                    "n": n, "k": k, "density": density, "dtype": args.dtype, "method": name,
                    "exact": SELECTORS.get(name), "median_s": med, "min_s": best, "repeat": args.repeat,
                    "per_element_s": med / n,
                    "speedup_vs_argpartition": times["argpartition"][0] / med,
                    "floor_multiple": med / floor, "recall": recall,
                })
    return records


def table(records: List[Dict[str, object]]) -> str:
    head = f"{'n':>10} {'density':>8} {'k':>8} {'method':<15} {'median ms':>10} {'vs argpart':>10} {'x floor':>8} {'recall':>7}"
    lines = [head, "-" * len(head)]
    for r in records:
        recall = "" if r["recall"] is None else f"{r['recall']:.4f}"
        lines.append(
            f"{r['n']:>10} {r['density']:>8g} {r['k']:>8} {r['method']:<15} {r['median_s'] * 1e3:>10.3f} "
            f"{r['speedup_vs_argpartition']:>9.2f}x {r['floor_multiple']:>7.2f}x {recall:>7}"
        )
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    records = bench(args)
    print(table(records))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine(), "records": records}, f, indent=1)
        print(f"wrote {len(records)} records to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
