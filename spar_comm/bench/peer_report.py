"""bench_peers.py's report: its title, its tables (time per step against
DDP and bytes between nodes; where spar_comm's communication went; time to
each held-out target) and its plot."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np

from .peers import PHASES, PeerSettings


def title(model: str, parameters: int, layout: str, batch_size: int, settings: PeerSettings,
          system_malloc: bool) -> str:
    """What was measured, in one line: the model, the ranks' ``layout``, the
    batch, the rounds and spar_comm's settings."""
    return (f"{model}, {parameters:,} parameters; {layout}; batch {batch_size} per rank; median of "
            f"{settings.repeat}; spar_comm: {settings.selector} at density {settings.density:g}"
            + (f", parameters below {settings.dense_below:,} dense" if settings.dense_below else "")
            + ("; glibc's own malloc thresholds" if system_malloc else ""))


def table(results: List[dict]) -> str:
    """The tables of ``measure``'s results, a row a mode; failed modes with their errors."""
    w = max(18, 2 + max(len(r["mode"]) for r in results))  # the mode column
    lines = [f"{'mode':<{w}}{'ms/step':>10}{'mean':>10}{'x DDP':>8}{'MB between nodes':>18}  note"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"{r['mode']:<{w}}{r['status']:>10}{'':>18}{'':>18}  {r['error']}")
            continue
        ratio = f"{r['ratio_to_ddp']:.2f}" if r.get("ratio_to_ddp") else "-"
        sent = f"{r['bytes_inter'] / 1e6:.4g}" if r["bytes_inter"] is not None else "unknown"
        lines.append(f"{r['mode']:<{w}}{r['step_ms']:>10.1f}{r['step_ms_mean']:>10.1f}{ratio:>8}{sent:>18}  {r['note']}")
    timed = [r for r in results if "phases_ms" in r]
    if timed:
        lines += ["", "where spar_comm's communication went, ms (medians, each phase on its slowest rank):",
                  f"{'mode':<{w}}" + "".join(f"{name:>9}" for name in PHASES)]
        lines += [f"{r['mode']:<{w}}" + "".join(f"{r['phases_ms'][name]:>9.1f}" for name in PHASES) for r in timed]
    curves = [r for r in results if r.get("curve")]
    if curves:
        lines += ["", f"time to target: s of training (the slowest rank's steps summed) until the "
                      f"{curves[0]['metric']} first reached each target, steps in brackets:",
                  f"{'mode':<{w}}" + "".join(f"{'to ' + format(t['target'], 'g'):>20}" for t in curves[0]["to_target"])
                  + f"{'final':>10}{'after':>8}"]
        for r in curves:
            cells = [f"{t['seconds']:.1f} ({t['steps']}) {t['ratio_to_ddp']:.2f}x" if t.get("ratio_to_ddp")
                     else f"{t['seconds']:.1f} ({t['steps']})" if t["seconds"] is not None else "not reached"
                     for t in r["to_target"]]
            lines.append(f"{r['mode']:<{w}}" + "".join(f"{c:>20}" for c in cells)
                         + f"{r['curve'][-1][2]:>10.4f}{r['curve'][-1][0]:>8}")
    return "\n".join(lines)


def plot(results: List[dict], title: str, path: str, targets: Sequence[float]) -> None:
    """ms per step by mode; beside it, where measured, each mode's held-out
    metric against its training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [r for r in results if r.get("curve")]
    fig, axes = plt.subplots(1, 2 if curves else 1, squeeze=False,
                             figsize=(14 if curves else 8, 0.35 * len(results) + 2.5))
    ax = axes[0, 0]
    names = [r["mode"] for r in results][::-1]
    values = [r.get("step_ms", 0.0) for r in results][::-1]
    bars = ax.barh(names, values, color=["tab:blue" if n.startswith("spar_") else "tab:gray" for n in names])
    for bar, r in zip(bars, results[::-1]):
        if r["status"] != "ok":
            ax.text(0, bar.get_y() + bar.get_height() / 2, f" {r['status']}", va="center", color="tab:red")
    ax.set_xlabel("ms per step (slowest rank, median)")
    ax.set_title(title.replace("; ", "\n", 1), fontsize=9)
    if curves:
        ax = axes[0, 1]
        for r in curves:
            points = np.array(r["curve"])
            ax.plot(points[:, 1], points[:, 2], marker=".", label=r["mode"],
                    linestyle="-" if r["mode"].startswith("spar_") else "--")
        for target in targets:
            ax.axhline(target, color="black", linewidth=0.8, linestyle=":")
        ax.set_xlabel("s of training (the slowest rank's steps summed)")
        ax.set_ylabel(curves[0]["metric"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
