"""What a long run must not grow: a rank's resident memory, open file
descriptors and mapped /dev/shm segments, snapshotted and compared with the
start (drivers/soak.py), so that a leak shows as growth, not as a crash days later."""
from __future__ import annotations

import os
import re
from typing import Dict, List

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
