"""What a long run must not grow: a rank's resident memory, open file
descriptors and mapped /dev/shm segments, snapshotted and compared with the
start (drivers/soak.py), so that a leak shows as growth, not as a crash days
later; and the peak of a rank's resident memory while a block runs
(drivers/bench_checkpoint.py), which a snapshot after it would miss."""
from __future__ import annotations

import os
import re
import threading
from typing import Any, Dict, List

import numpy as np

#: What a snapshot holds, and how each figure is measured.
FIGURES = ("rss_kib", "fds", "shm_segments")
SHM = re.compile(r"\s(/dev/shm/\S+)")


def snapshot() -> dict:
    """This rank's resident memory, open file descriptors and mapped /dev/shm segments."""
    with open("/proc/self/status") as status:
        rss = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    with open("/proc/self/maps") as maps:
        segments = sorted({match.group(1) for match in map(SHM.search, maps) if match})
    return {"rss_kib": rss, "fds": len(os.listdir("/proc/self/fd")), "shm_segments": len(segments), "segments": segments}


def growth(start: dict, later: dict) -> Dict[str, float]:
    """Relative growth of each figure from ``start`` to ``later`` (0 where both are 0)."""
    return {name: (later[name] - start[name]) / start[name] if start[name] else (np.inf if later[name] else 0.0)
            for name in FIGURES}


def worst(snapshots: Dict[str, List[dict]], phase: str) -> Dict[str, float]:
    """The largest growth over ranks of each figure, from the start to ``phase``."""
    per_rank = [growth(start, later) for start, later in zip(snapshots["start"], snapshots[phase])]
    return {name: max(g[name] for g in per_rank) for name in FIGURES}


def growth_table(snapshots: Dict[str, List[dict]], verdicts: Dict[str, Dict[str, float]]) -> str:
    """A line a phase of ``verdicts`` (``worst``'s growths): each figure on the
    rank that grew most, its value at the start and in that phase."""
    ranks = range(len(snapshots["start"]))
    lines = [f"{'phase':<8} " + " ".join(f"{name:>14}" for name in FIGURES)
             + "   (worst rank: value at start -> now, growth)"]
    for phase, figures in verdicts.items():
        cells = []
        for name in FIGURES:
            rank = max(ranks, key=lambda r: growth(snapshots["start"][r], snapshots[phase][r])[name])
            cells.append(f"{snapshots['start'][rank][name]}->{snapshots[phase][rank][name]} {figures[name]:+.1%}")
        lines.append(f"{phase:<8} " + "  ".join(cells))
    return "\n".join(lines)


class PeakRSS:
    """The peak resident memory of this process while the block runs, sampled
    every millisecond, in KiB above what it was at the start (``growth``)."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss_kib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss_kib())

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_kib())
        self.growth = self.peak - self.start


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
