"""drivers/train_torch.py, the plain PyTorch script changed in a few marked
lines, trains under mpiexec; its change stays about five lines."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, find_mpiexec

pytest.importorskip("torch")
SCRIPT = ROOT / "drivers" / "train_torch.py"


def test_the_change_to_a_plain_script_is_about_five_marked_lines():
    marked = [line for line in SCRIPT.read_text().splitlines() if line.rstrip().endswith("# spar_comm")]
    assert 4 <= len(marked) <= 6, marked


def test_the_example_trains_on_two_ranks():
    run = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, str(SCRIPT), "--algorithm", "hitopk",
                          "--epochs", "3", "--density", "0.1"], cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("epoch")]
    assert len(lines) == 3, run.stdout  # rank 0 alone prints
    accuracy = float(lines[-1].split()[-1])
    assert accuracy > 0.5, run.stdout  # ten classes: chance is 0.1
