"""Each algorithm's predicted time on a cluster one does not have
(predict.py): at one point, or along one quantity (density, size or nodes)
with the points where the fastest algorithm changes, and their tables and
plot."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from . import breakdown, fastest, predict
from .algorithms import STEPS
from .machine import Cluster, Machine, beta_to_gbps

#: What a sweep may vary.
SWEEPS = ("density", "size", "nodes")


@dataclass(frozen=True)
class Scenario:
    """A cluster (``cores`` shared by all its ranks, on an emulated one) and
    the gradient it reduces: its size, density, selector, dtype and codecs."""

    nodes: int
    ranks_per_node: int
    cores: Optional[int]
    size: int
    density: float
    selector: str
    dtype: str
    values: Optional[str]
    indices: Optional[str]

    def cluster(self) -> Cluster:
        """The cluster as the cost model prices it."""
        return Cluster(self.nodes, self.ranks_per_node, self.cores)


def times(scenario: Scenario, machine: Machine) -> Dict[str, float]:
    """Every algorithm's predicted seconds per call in ``scenario``."""
    return predict(scenario.cluster(), scenario.size, machine, scenario.dtype, scenario.density, scenario.selector,
                   algorithms=list(STEPS), values=scenario.values, indices=scenario.indices)


def sweep_values(sweep: str) -> List[float]:
    """The grid of a sweep: densities four a decade from 1e-5 to 1, sizes of
    4 Ki to 2 Gi elements, or 1 to 1024 nodes, by powers of 2."""
    if sweep == "density":
        return [10 ** (e / 4) for e in range(-20, 1)]  # 1e-5 .. 1, four per decade
    if sweep == "size":
        return [2**e for e in range(12, 32)]  # 4 Ki .. 2 Gi elements
    return [2**e for e in range(0, 11)]  # 1 .. 1024 nodes


def break_even(scenario: Scenario, machine: Machine, sweep: str, values: Sequence[float],
               bests: Sequence[str]) -> List[dict]:
    """Where the fastest algorithm changes: bisected between grid points (in log
    space; node counts to the integer)."""
    found = []
    for lo, hi, before, after in zip(values, values[1:], bests, bests[1:]):
        if before == after:
            continue
        for _ in range(40):
            mid = math.sqrt(lo * hi)
            if sweep != "density":
                mid = int(round(mid))
                if mid in (lo, hi):
                    break
            if fastest(times(dataclasses.replace(scenario, **{sweep: mid}), machine)) == before:
                lo = mid
            else:
                hi = mid
        found.append({"value": hi, "from": before, "to": after})
    return found


def run_sweep(scenario: Scenario, machine: Machine, sweep: str) -> dict:
    """Every algorithm's time at each grid point of ``sweep``, the fastest
    there, and the break-even points between."""
    values = sweep_values(sweep)
    points = [times(dataclasses.replace(scenario, **{sweep: v}), machine) for v in values]
    bests = [fastest(p) for p in points]
    crossings = break_even(scenario, machine, sweep, values, bests)
    return {"sweep": sweep, "points": [{"value": v, "algorithms": p, "best": b}
                                       for v, p, b in zip(values, points, bests)], "break_even": crossings}


def show_value(sweep: str, value: float) -> str:
    """A grid point as the tables write it: a density to 3 digits, a size or node count whole."""
    return f"{value:.3g}" if sweep == "density" else f"{int(value):,}"


def title(scenario: Scenario, machine: Machine, sweep: Optional[str] = None) -> str:
    """The scenario in one line, less what ``sweep`` varies, with the machine's links."""
    s = scenario
    parts = {
        "nodes": f"{s.nodes} nodes x {s.ranks_per_node}" if sweep != "nodes" else f"nodes x {s.ranks_per_node}",
        "size": f"{s.size:,} elements" if sweep != "size" else None,
        "density": f"density {s.density:g}" if sweep != "density" else None,
    }
    links = f"inter {beta_to_gbps(machine.beta_inter):.4g} Gbit/s, intra {beta_to_gbps(machine.beta_intra):.4g} Gbit/s"
    codecs = "".join(f", {name} {kind}" for kind, name in (("values", s.values), ("indices", s.indices)) if name)
    cores = f"; {s.cores} cores shared" if s.cores else ""
    return ", ".join(p for p in parts.values() if p) + f", {s.dtype}, {s.selector}{codecs}; {links}{cores}"


def point_table(scenario: Scenario, machine: Machine, predicted: Dict[str, float]) -> str:
    """A line an algorithm: its time, against dense, and its parts; the fastest marked."""
    best = fastest(predicted)
    lines = [f"# {title(scenario, machine)}",
             f"{'algorithm':<14} {'ms/step':>10} {'vs dense':>8} {'select':>8} {'intra':>8} {'inter':>8} {'local':>8}"]
    for name, seconds in predicted.items():
        parts = breakdown(name, scenario.cluster(), scenario.size, machine, scenario.dtype, scenario.density,
                          scenario.selector, values=scenario.values, indices=scenario.indices)
        cells = " ".join(f"{parts[p] * 1e3:8.3f}" for p in ("select", "intra", "inter", "local"))
        mark = "  <- fastest" if name == best else ""
        lines.append(f"{name:<14} {seconds * 1e3:10.3f} {predicted['dense'] / seconds:7.2f}x {cells}{mark}")
    return "\n".join(lines)


def sweep_table(scenario: Scenario, machine: Machine, result: dict) -> str:
    """A line a grid point of ``run_sweep``'s result, then its break-even points."""
    sweep = result["sweep"]
    names = list(result["points"][0]["algorithms"])
    lines = [f"# sweep of {sweep}: {title(scenario, machine, sweep)}; ms per step",
             f"{sweep:>14} " + " ".join(f"{n:>13}" for n in names) + "  fastest"]
    for point in result["points"]:
        cells = " ".join(f"{point['algorithms'][n] * 1e3:13.3f}" for n in names)
        lines.append(f"{show_value(sweep, point['value']):>14} {cells}  {point['best']}")
    lines.append("break-even points:" if result["break_even"] else
                 "break-even points: none (one algorithm is fastest throughout)")
    lines += [f"  {sweep} {show_value(sweep, c['value'])}: {c['from']} -> {c['to']}" for c in result["break_even"]]
    return "\n".join(lines)


def plot(scenario: Scenario, machine: Machine, result: dict, path: str) -> None:
    """``run_sweep``'s result: every algorithm's time against the swept
    quantity, log-log, the break-even points marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sweep = result["sweep"]
    values = [point["value"] for point in result["points"]]
    points = [point["algorithms"] for point in result["points"]]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    for name in points[0]:
        ax.plot(values, [p[name] * 1e3 for p in points], marker=".", label=name)
    for c in result["break_even"]:
        ax.axvline(c["value"], color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"→ {c['to']}", (c["value"], 1), xycoords=("data", "axes fraction"), rotation=90,
                    va="top", ha="right", fontsize=8, color="dimgrey")
    ax.set_xscale("log")
    ax.set_yscale("log")
    unit = {"density": "density (k / n)", "size": "gradient size (elements)", "nodes": "nodes"}[sweep]
    ax.set_xlabel(unit)
    ax.set_ylabel("predicted time per allreduce (ms)")
    ax.set_title(title(scenario, machine, sweep), fontsize=9)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
