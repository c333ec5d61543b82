"""drivers/bench_checkpoint.py end to end: a small run under mpiexec, and bad input."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_a_small_run_measures_save_load_and_growth(run_driver, tmp_path):
    out, folder = tmp_path / "ck.json", tmp_path / "saves"
    result = run_driver("bench_checkpoint.py", "--parameters", 300_000, "--repeat", 2, "--folder", folder,
                        "--out", out, ranks=2)
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["meta"]["tool"] == "bench_checkpoint" and document["meta"]["world_size"] == 2
    (row,) = document["results"]
    assert row["save_s"] > 0 and row["load_s"] > 0 and len(row["growth_per_rank_kib"]) == 2
    # parameters, velocity, residual (topka: the whole vector) and the aids' velocity, in float32
    assert row["state_kib"] == 4 * 300_000 * 4 // 1024
    assert row["growth_over_state"] == max(row["growth_per_rank_kib"]) / row["state_kib"]
    assert sorted(p.name for p in folder.iterdir()) == ["ck0.h5", "ck0.h5.parts", "ck1.h5", "ck1.h5.parts"]


def test_bad_flags_exit_2(run_driver):
    result = run_driver("bench_checkpoint.py", "--repeat", 0)
    assert result.returncode == 2 and "--repeat" in result.stderr
