"""drivers/bench_accuracy.py: every cell is the run train.py would make with
the same flags (checked against train.py itself), the table's arithmetic
(spar_comm.bench.accuracy), and bad input."""
from __future__ import annotations

import json
import re
import statistics

import pytest

from spar_comm.bench import accuracy
from spar_comm.training import TrainConfig

AIDS_OFF_FLAGS = ["--no-momentum-correction", "--no-momentum-masking", "--density-schedule", "fixed", "--density-warmup", "0",
                  "--clip-norm", "0"]


def accuracy_of(result) -> float:
    assert result.returncode == 0, result.stdout + result.stderr
    return float(re.search(r"held-out accuracy ([\d.]+)", result.stdout).group(1))


@pytest.mark.slow
def test_each_cell_is_the_train_py_run_of_its_flags(run_driver, tmp_path):
    out = tmp_path / "accuracy.json"
    result = run_driver("bench_accuracy.py", "--densities", "0.05", "--seeds", "0,1", "--workload", "--epochs 2",
                        "--dense-values", "int8", "--out", out, ranks=2, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [(r["cell"], r["seed"]) for r in runs] == [
        (cell, seed) for cell in ("dense", "dense int8", "hitopk 0.05 aids on", "hitopk 0.05 aids off")
        for seed in (0, 1)]
    pick = {(r["cell"], r["seed"]): r["final_metric"] for r in runs}
    common = ["--epochs", "2", "--trace", "", "--no-progress"]
    dense = run_driver("train.py", "--algorithm", "dense", "--seed", "1", *common, ranks=2)
    aided = run_driver("train.py", "--algorithm", "hitopk", "--density", "0.05", "--seed", "0", *common, ranks=2)
    plain = run_driver("train.py", "--algorithm", "hitopk", "--density", "0.05", "--seed", "1", *common,
                       *AIDS_OFF_FLAGS, ranks=2)
    narrow = run_driver("train.py", "--algorithm", "dense", "--values", "int8", "--seed", "0", *common, ranks=2)
    assert accuracy_of(dense) == pytest.approx(pick[("dense", 1)], abs=5e-5)
    assert accuracy_of(aided) == pytest.approx(pick[("hitopk 0.05 aids on", 0)], abs=5e-5)
    assert accuracy_of(plain) == pytest.approx(pick[("hitopk 0.05 aids off", 1)], abs=5e-5)
    assert accuracy_of(narrow) == pytest.approx(pick[("dense int8", 0)], abs=5e-5)
    assert "hitopk 0.05 aids off" in result.stdout.splitlines()[-1]


def test_the_table_gives_mean_spread_and_distance_from_dense():
    runs = [{"cell": "dense", "final_metric": m, "mean_density": 1.0} for m in (0.96, 0.98)]
    runs += [{"cell": "hitopk 0.001 aids on", "final_metric": m, "mean_density": d}
             for m, d in ((0.90, 0.001), (0.94, 0.002), (0.95, 0.003))]
    lines = accuracy.table(runs).splitlines()
    dense, sparse = lines[1].split(), lines[2].split()
    assert dense[1:5] == ["0.9700", f"{statistics.stdev([0.96, 0.98]):.4f}", "0.9600", "0.9800"] and dense[5] == "-"
    assert sparse[4:] == ["0.9300", f"{statistics.stdev([0.90, 0.94, 0.95]):.4f}", "0.9000", "0.9500", "-4.00p", "3",
                          "0.002"]
    assert dense[-1] == "1"  # the mean density sent a step


def test_an_aid_set_switches_on_what_it_names_and_off_the_rest():
    base = TrainConfig(clip_norm=2.0, density_warmup=3)
    assert accuracy.aid_changes("on", base) == {}
    off = accuracy.aid_changes("off", base)
    assert off == accuracy.AIDS_OFF
    both = accuracy.aid_changes("warmup+mc", base)
    assert (both["momentum_correction"], both["momentum_masking"], both["density_warmup"], both["clip_norm"]) == \
        (True, False, 3, 0.0)
    masked = accuracy.aid_changes("mc+mask", base)
    assert (masked["momentum_correction"], masked["momentum_masking"], masked["density_warmup"]) == (True, True, 0)
    assert (both["density_schedule"], masked["density_schedule"]) == ("warmup", "fixed")
    accordion = accuracy.aid_changes("mc+accordion", base)
    assert (accordion["density_schedule"], accordion["momentum_correction"], accordion["density_warmup"]) == \
        ("accordion", True, 0)


@pytest.mark.parametrize("args, words", [
    (["--aids", "on,mc+nope"], "--aids"),
    (["--aids", "mc+mc"], "--aids"),
    (["--aids", "warmup+accordion"], "--aids"),
    (["--workload", "--density 0.5"], "--workload sets --density"),
    (["--workload=--seed=3"], "--workload sets --seed"),
    (["--workload", "--epochs -1"], "epochs"),
    (["--workload=--no-such-flag"], "unrecognized arguments"),
    (["--densities", "0.01,2"], "--densities"),
    (["--algorithm", "dense"], "--algorithm"),
    (["--dense-values", "float16,int4"], "--dense-values"),
])
@pytest.mark.slow
def test_bad_arguments_exit_2_on_every_rank(run_driver, args, words):
    result = run_driver("bench_accuracy.py", *args, ranks=2)
    assert result.returncode == 2 and words in result.stderr, result.stderr
