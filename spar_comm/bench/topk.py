"""bench_topk.py's measurement: every selector and baseline on the same
Gaussian data at every size, density and dtype, with the recall of each
selector against the exact top-k set; the records the cost model reads
(``costmodel.calibrate.topk_rates``), their table, and the machine they
were measured on."""
from __future__ import annotations

import datetime
import functools
import os
import platform
import socket
from typing import Dict, List, Sequence

import numpy as np

from ..kernels import SELECTORS
from ..kernels.selection import exact_topk
from .topk_devices import CpuBench


def measure(where: CpuBench, device: str, sizes: Sequence[int], densities: Sequence[float], dtypes: Sequence[str],
            methods: Sequence[str], repeat: int, seed: int) -> List[Dict[str, object]]:
    """One record per (dtype, n, density, method or baseline), timed by
    ``where`` (the bench of ``device``) as the median of ``repeat`` runs after
    one warm-up; k = max(1, round(density * n)). Stateful methods
    (``*_warm``) see the same array every run: their best case."""
    rng = np.random.default_rng(seed)
    records: List[Dict[str, object]] = []
    for dtype in dtypes:
        for n in sizes:
            host = rng.standard_normal(n, dtype=np.float32).astype(dtype)
            x = where.put(host)
            floor = where.time(where.floor(x), repeat)
            for density in densities:
                k = max(1, min(n, round(density * n)))
                truth = exact_topk(host, k)
                runs = where.baselines(x, k)
                for method in methods:
                    runs[method] = functools.partial(where.make(method), x, k)
                    if where.graphs:
                        runs[method + "+graph"] = where.graph(functools.partial(where.make(method), x, k))
                times = {name: where.time(run, repeat) for name, run in runs.items()}
                times["floor"] = floor
                reference = times[where.reference][0]
                for name, (med, best) in times.items():
                    recall, method = None, name.removesuffix("+graph")
                    matches = None
                    if method in SELECTORS or name == "cub.DeviceTopK":
                        got = where.to_host(runs[name]())
                        recall = np.intersect1d(got, truth).size / truth.size
                        matches = got.tolist() == truth.tolist()  # the contract: these positions, ascending
                    records.append({
                        "n": n, "k": k, "density": density, "dtype": dtype, "device": device, "method": name,
                        "exact": SELECTORS.get(method), "median_s": med, "min_s": best, "repeat": repeat,
                        "per_element_s": med / n, "read_gbps": host.nbytes / med / 1e9,
                        "reference": where.reference, "speedup_vs_reference": reference / med,
                        "floor_multiple": med / floor[0], "recall": recall, "matches_reference": matches,
                    })
    return records


def table(records: List[Dict[str, object]]) -> str:
    """A row a record: time, speed-up over the reference baseline, multiple of the floor, bandwidth, recall."""
    reference = records[0]["reference"] if records else ""
    head = (f"{'n':>10} {'density':>8} {'k':>8} {'dtype':<8} {'method':<17} {'median ms':>10} "
            f"{'vs ' + reference:>14} {'x floor':>8} {'GB/s':>8} {'recall':>7}")
    lines = [head, "-" * len(head)]
    for r in records:
        recall = "" if r["recall"] is None else f"{r['recall']:.4f}"
        lines.append(
            f"{r['n']:>10} {r['density']:>8g} {r['k']:>8} {r['dtype']:<8} {r['method']:<17} {r['median_s'] * 1e3:>10.3f} "
            f"{r['speedup_vs_reference']:>13.2f}x {r['floor_multiple']:>7.2f}x {r['read_gbps']:>8.2f} {recall:>7}"
        )
    return "\n".join(lines)


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
