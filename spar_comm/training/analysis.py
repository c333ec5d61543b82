"""Offline analysis of HDF5 traces: phase breakdown, bytes, throughput, a
comparison of several runs, the paper-style stacked-bar plot and a
Chrome/Perfetto export. ``drivers/analyze.py`` is its command line.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .trace import PHASES, Trace

#: Phases in the order a step runs them; "other" is the step's time outside them.
PARTS = ("data", "compute", "select", "comm_intra", "comm_inter", "update", "other")


def window(trace: Trace, steps: Optional[Tuple[int, int]] = None) -> np.ndarray:
    """Row numbers of the steps in ``[a, b)`` (all rows when ``steps`` is None)."""
    rows = np.arange(trace.steps)
    if steps is None:
        return rows
    step = trace.data["step"]
    return rows[(step >= steps[0]) & (step < steps[1])]


def phase_times(trace: Trace, rows: np.ndarray) -> Dict[str, np.ndarray]:
    """[step, rank] seconds of each part, "other" included."""
    times = {p: trace.data[f"phases/{p}"][rows] for p in PHASES}
    inside = sum(times[p] for p in PARTS if p != "other")
    times["other"] = np.maximum(times["step"] - inside, 0.0)
    return times


def summarize(trace: Trace, steps: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """The figures ``analyze.py`` prints: per phase mean, median, p95 and slowest
    rank; bytes per step; throughput; the last evaluation."""
    rows = window(trace, steps)
    times = phase_times(trace, rows)
    attrs, config = trace.attrs, json.loads(trace.attrs["config"])
    phases = {}
    for name in PARTS + ("step",):
        t = times[name]
        per_rank = t.mean(axis=0) if t.size else np.zeros(len(trace.hosts))
        phases[name] = dict(
            mean=float(t.mean()) if t.size else 0.0,
            median=float(np.median(t)) if t.size else 0.0,
            p95=float(np.percentile(t, 95)) if t.size else 0.0,
            slowest_rank=int(np.argmax(per_rank)),
            slowest_rank_mean=float(per_rank.max()),
        )
    # A step ends when its slowest rank ends: the job's time is the sum of per-step maxima.
    wall = float(times["step"].max(axis=1).sum()) if rows.size else 0.0
    world = int(attrs["world_size"])
    evals = {name.split("/", 1)[1]: trace.data[name] for name in trace.data if name.startswith("eval/")}
    return dict(
        path=trace.path,
        algorithm=str(attrs["algorithm"]),
        selector=str(attrs["selector"]),
        density=float(attrs["density"]),
        world_size=world,
        topology=str(attrs.get("topology", "")),
        parameters=int(attrs.get("parameters", 0)),
        steps=int(rows.size),
        phases=phases,
        bytes_per_step={b: float(trace.data[f"bytes/{b}"][rows].mean()) if rows.size else 0.0 for b in ("intra", "inter")},
        k_mean=float(trace.data["k"][rows].mean()) if rows.size else 0.0,
        steps_per_s=rows.size / wall if wall > 0 else 0.0,
        samples_per_s=rows.size * world * int(config["batch_size"]) / wall if wall > 0 else 0.0,
        final_loss=float(trace.data["loss"][rows][-1]) if rows.size else float("nan"),
        test_metric_name=str(attrs.get("test_metric_name", "metric")),
        test_metric=float(evals["test_metric"][-1]) if len(evals.get("test_metric", [])) else float("nan"),
    )


def label(summary: Dict[str, Any]) -> str:
    return f"{summary['algorithm']}" + (f"/{summary['selector']}" if summary["algorithm"] not in ("dense", "hier_dense") else "")


def format_report(summaries: Sequence[Dict[str, Any]]) -> str:
    """A breakdown table per trace, then the traces side by side."""
    lines: List[str] = []
    for s in summaries:
        lines.append(
            f"{s['path']}: {label(s)} density {s['density']:g}, {s['topology'] or str(s['world_size']) + ' ranks'}, "
            f"{s['parameters']:,} parameters, {s['steps']} steps"
        )
        lines.append(f"  {'phase':<11}{'mean ms':>10}{'median ms':>11}{'p95 ms':>10}{'share':>8}   slowest rank")
        step_mean = s["phases"]["step"]["mean"] or 1.0
        for name in PARTS + ("step",):
            p = s["phases"][name]
            lines.append(
                f"  {name:<11}{1e3 * p['mean']:>10.3f}{1e3 * p['median']:>11.3f}{1e3 * p['p95']:>10.3f}"
                f"{100 * p['mean'] / step_mean:>7.1f}%   {p['slowest_rank']} ({1e3 * p['slowest_rank_mean']:.3f} ms)"
            )
        b = s["bytes_per_step"]
        lines.append(
            f"  bytes/step per rank: intra {b['intra'] / 1e6:.3f} MB, inter {b['inter'] / 1e6:.3f} MB; "
            f"k {s['k_mean']:.0f}; {s['steps_per_s']:.2f} steps/s, {s['samples_per_s']:.0f} samples/s; "
            f"{s['test_metric_name']} {s['test_metric']:.4f}"
        )
        lines.append("")
    if len(summaries) > 1:
        names = [label(s) for s in summaries]
        width = max(12, *(len(n) + 2 for n in names))
        lines.append("side by side (mean ms per step unless noted)")
        lines.append(f"  {'':<16}" + "".join(f"{n:>{width}}" for n in names))
        rows = [(name, [1e3 * s["phases"][name]["mean"] for s in summaries], "{:.3f}") for name in PARTS + ("step",)]
        rows += [
            ("intra MB/step", [s["bytes_per_step"]["intra"] / 1e6 for s in summaries], "{:.3f}"),
            ("inter MB/step", [s["bytes_per_step"]["inter"] / 1e6 for s in summaries], "{:.3f}"),
            ("steps/s", [s["steps_per_s"] for s in summaries], "{:.2f}"),
            ("speed-up", [s["steps_per_s"] / (summaries[0]["steps_per_s"] or 1.0) for s in summaries], "{:.2f}x"),
            ("final loss", [s["final_loss"] for s in summaries], "{:.4f}"),
        ]
        for name, values, fmt in rows:
            lines.append(f"  {name:<16}" + "".join(f"{fmt.format(v):>{width}}" for v in values))
    return "\n".join(lines).rstrip() + "\n"


def plot(traces: Sequence[Trace], summaries: Sequence[Dict[str, Any]], path: str) -> None:
    """A stacked bar of mean time per phase for each trace, the loss curves, and
    the held-out metric against wall time (the paper's time-to-accuracy view)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curves, accuracy) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw=dict(width_ratios=[1, 1.3, 1.3]))
    labels = [label(s) for s in summaries]  # file names only where labels alone are ambiguous
    names = labels if len(set(labels)) == len(labels) else [
        f"{text}\n{os.path.basename(s['path'])}" for text, s in zip(labels, summaries)]
    colors = plt.get_cmap("tab10").colors
    bottom = np.zeros(len(summaries))
    for i, part in enumerate(PARTS):
        heights = np.array([1e3 * s["phases"][part]["mean"] for s in summaries])
        bars.bar(names, heights, bottom=bottom, label="other (waits, checks)" if part == "other" else part,
                 color=colors[i], width=0.6)
        bottom += heights
    bars.set_ylabel("mean time per step (ms)")
    bars.set_title("time breakdown per step")
    bars.legend(fontsize=8, loc="upper center", ncol=3)
    bars.tick_params(axis="x", labelsize=8)
    bars.set_ylim(0, bottom.max() * 1.3 if bottom.max() > 0 else 1)
    for trace, s in zip(traces, summaries):
        curves.plot(trace.data["step"], trace.data["loss"], label=label(s), linewidth=1)
    curves.set_xlabel("step")
    curves.set_ylabel("training loss (mean over ranks)")
    curves.set_yscale("log")
    curves.set_title("loss")
    curves.grid(alpha=0.3)
    curves.legend(fontsize=8)
    time_to_accuracy(accuracy, traces, summaries)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def time_to_accuracy(axes: Any, traces: Sequence[Trace], summaries: Sequence[Dict[str, Any]]) -> None:
    """Held-out metric at each evaluation against the run's wall time, one curve per trace."""
    for trace, s in zip(traces, summaries):
        axes.plot(trace.data["eval/wall"], trace.data["eval/test_metric"], marker=".", label=label(s), linewidth=1)
    names = {s["test_metric_name"] for s in summaries}
    axes.set_xlabel("wall time (s)")
    axes.set_ylabel(f"held-out {names.pop() if len(names) == 1 else 'metric'}")
    axes.set_title("time to accuracy")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)


def chrome_events(trace: Trace, steps: Optional[Tuple[int, int]] = None) -> Dict[str, Any]:
    """Chrome/Perfetto trace events: a process per rank, a track (thread) per phase.

    The trace keeps durations, not clocks: a step starts on every rank when the
    slowest rank finished the one before (the ranks meet in the allreduce), and
    the phases of a step are laid end to end in the order the step runs them.
    """
    rows = window(trace, steps)
    times = phase_times(trace, rows)
    starts = np.concatenate(([0.0], np.cumsum(times["step"].max(axis=1))[:-1]))
    events: List[Dict[str, Any]] = []
    tracks = ("step",) + PARTS
    for rank, host in enumerate(trace.hosts):
        events.append(dict(name="process_name", ph="M", pid=rank, args=dict(name=f"rank {rank} ({host})")))
        for tid, name in enumerate(tracks):
            events.append(dict(name="thread_name", ph="M", pid=rank, tid=tid, args=dict(name=name)))
    for i, row in enumerate(rows):
        step = int(trace.data["step"][row])
        for rank in range(len(trace.hosts)):
            offset = starts[i]
            events.append(_event("step", rank, 0, offset, times["step"][i, rank], step))
            for tid, name in enumerate(PARTS, start=1):
                duration = times[name][i, rank]
                events.append(_event(name, rank, tid, offset, duration, step))
                offset += duration
    return dict(traceEvents=events, displayTimeUnit="ms", otherData=dict(source=trace.path))


def _event(name: str, pid: int, tid: int, start: float, duration: float, step: int) -> Dict[str, Any]:
    return dict(name=name, ph="X", pid=pid, tid=tid, ts=1e6 * float(start), dur=1e6 * float(duration), args=dict(step=step))
