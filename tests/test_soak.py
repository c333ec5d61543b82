"""drivers/soak.py: a few steps and rebuilds at 4 ranks as 2x2, so the soak
keeps working (the full run is 10,000 steps; see docs/results/soak.md), and its growth
arithmetic (spar_comm.bench.resources)."""
from __future__ import annotations

import json
import math
import os

import pytest

from spar_comm.bench.resources import growth, worst


@pytest.mark.slow
def test_a_short_soak_passes_and_leaves_nothing_in_dev_shm(run_driver, tmp_path):
    out = tmp_path / "soak.json"
    result = run_driver("soak.py", "--ranks-per-node", "2", "--steps", "60", "--rebuilds", "2", "--size", "4096",
                        "--out", out, ranks=4, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    document = json.loads(out.read_text())
    assert document["passed"] and set(document["snapshots"]) == {"start", "steps", "rebuilt"}
    for phase in document["snapshots"].values():
        assert len(phase) == 4 and all(s["rss_kib"] > 0 and s["fds"] > 0 for s in phase)
    assert max(document["growth"]["steps"].values()) < 0.05
    segments = {path for phase in document["snapshots"].values() for s in phase for path in s["segments"]}
    assert segments, "the shared-memory algorithms map segments of /dev/shm"
    assert not [path for path in segments if os.path.exists(path)], "left in /dev/shm after the exit"


def test_growth_is_relative_to_the_start_and_the_worst_rank_counts():
    start = {"rss_kib": 1000, "fds": 20, "shm_segments": 0}
    assert growth(start, {"rss_kib": 1100, "fds": 20, "shm_segments": 0}) == {"rss_kib": 0.1, "fds": 0.0, "shm_segments": 0.0}
    assert math.isinf(growth(start, {**start, "shm_segments": 1})["shm_segments"])
    snapshots = {"start": [start, start], "steps": [start, {**start, "fds": 25}]}
    assert worst(snapshots, "steps") == {"rss_kib": 0.0, "fds": 0.25, "shm_segments": 0.0}


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--steps", "0"], "--steps: must be >= 1"),
    (["--algorithms", "dense,nope"], "one of"),
    (["--bound", "-1"], "--bound"),
])
def test_bad_arguments_exit_2(run_driver, args, words):
    result = run_driver("soak.py", *args)
    assert result.returncode == 2 and words in result.stderr, result.stderr
