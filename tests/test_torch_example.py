"""drivers/train_torch.py, the plain PyTorch script changed in a few marked
lines, trains under mpiexec; its change stays about five lines."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, find_mpiexec

pytest.importorskip("torch")
SCRIPT = ROOT / "drivers" / "train_torch.py"


def test_the_change_to_a_plain_script_is_about_five_marked_lines():
    marked = [line for line in SCRIPT.read_text().splitlines() if line.rstrip().endswith("# spar_comm")]
    assert 5 <= len(marked) <= 8, marked


def test_the_ddp_example_changes_a_plain_ddp_script_in_a_few_marked_lines():
    """A few lines for the hook and the end; two more to save and resume on any world."""
    lines = (ROOT / "drivers" / "train_ddp.py").read_text().splitlines()
    marked = [line for line in lines if line.rstrip().endswith("# spar_comm")]
    assert 3 <= len(marked) <= 6, marked
    checkpoint = [line for line in lines if line.rstrip().endswith("# spar_comm checkpoint")]
    assert [line.split("=")[-1].split("(")[0].strip() for line in checkpoint] == [
        "sct.load_checkpoint", "sct.save_checkpoint"], checkpoint


@pytest.mark.slow
def test_the_example_trains_on_two_ranks():
    run = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(SCRIPT), "--algorithm", "hitopk",
                          "--epochs", "3", "--density", "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 3, run.stdout  # rank 0 alone prints
    accuracy = float(lines[-1].split()[-1])
    assert accuracy > 0.5, run.stdout  # ten classes: chance is 0.1


@pytest.mark.slow
def test_bench_overlap_writes_its_table_and_json(tmp_path):
    out = tmp_path / "overlap.json"
    run = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(ROOT / "drivers" / "bench_overlap.py"),
                          "--inputs", "16", "--hidden", "64", "--layers", "2", "--bucket-cap-mb", "0.01",
                          "--warmup", "1", "--repeat", "2", "--algorithms", "hitopk", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())["results"][0]
    assert result["algorithm"] == "hitopk" and result["buckets"] >= 2
    assert result["parameters"] == 16 * 64 + 64 + 2 * (64 * 64 + 64) + 64 * 10 + 10
    assert result["sync"]["wait"] > 0 and result["overlap"]["step"] > 0
    assert "hidden" in run.stdout


@pytest.mark.slow
def test_bench_overlap_refuses_a_bad_algorithm():
    run = subprocess.run([sys.executable, str(ROOT / "drivers" / "bench_overlap.py"), "--algorithms", "nope"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "one of dense" in run.stderr
