"""drivers/gpu_check.py, the one command for a GPU machine: its simulated mode
runs every kind of step without a GPU and writes both reports, and the
performance targets it reports are computed from the benchmark's figures
(spar_comm.bench.gpu_report)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT

from spar_comm.bench import gpu_report

pytest.importorskip("torch")
pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")


@pytest.mark.slow
def test_the_simulated_check_runs_every_kind_of_step_and_reports(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "drivers" / "gpu_check.py"), "--simulate", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("gpu-check on numba-cuda's CUDA simulator"), run.stdout
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    names = [s["name"] for s in report["steps"]]
    for kind in ("make test-gpu", "bench_topk.py", "bench_comm.py", "train.py", "train_torch.py", "train_ddp.py"):
        assert any(name.startswith(kind) for name in names), names
    assert all(s["status"] == "passed" for s in report["steps"]), report["steps"]
    assert {r["method"] for r in report["steps"][names.index("bench_topk.py")]["data"]["records"]} >= {"mstopk"}
    text = (tmp_path / "gpu-check.md").read_text()
    assert text.startswith("# GPU check: numba-cuda's CUDA simulator")
    assert "| make test-gpu, 1 rank | passed |" in text and "## Allreduce, 2 ranks" in text


def test_the_targets_come_from_the_largest_float32_figures():
    def record(method, ms, exact=None, matches=None, n=1 << 26):
        return {"n": n, "dtype": "float32", "density": 0.001, "method": method, "median_s": ms / 1e3,
                "exact": exact, "matches_reference": matches, "floor_multiple": ms / 0.1}

    records = [record("torch.topk", 1.5), record("threshold", 0.25, True, True), record("mstopk", 0.5, True, True),
               record("exact", 0.1, True, True, n=1 << 20), record("threshold_warm", 0.1, True, False),
               record("cub.DeviceTopK", 0.2), record("floor", 0.1)]
    lines = gpu_report.targets(records)
    assert lines[0] == ("- fastest exact selection at 2^26: `threshold`, 0.250 ms (target at most 0.25 ms: **held**), "
                        "6.00x torch.topk (target 6x: **held**), 2.50 reads of the vector")
    assert lines[1].endswith("cub.DeviceTopK 0.200 ms): **missed**")  # a library ran faster
    assert lines[2] == "- `mstopk`: 3.00x torch.topk (target 2x: **held**)"
    assert lines[3] == "- **not the reference's positions**: threshold_warm"  # fast, but wrong: never the fastest


def test_a_bad_budget_is_refused(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "drivers" / "gpu_check.py"), "--out", str(tmp_path),
                          "--budget", "5"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--budget must be more than" in run.stderr


def test_a_step_keeps_its_whole_output_in_the_log_and_no_terminal_codes_in_the_reports(tmp_path):
    """Seen on a GPU image: pytest's colours forced on, and Open MPI's library version ending in a NUL."""
    step = gpu_report.Step("noisy", [sys.executable, "-c", "print('\\x1b[32m3 passed\\x1b[0m in 1s\\x00')"], 30)
    step.run({}, remaining=30, log=tmp_path / "gpu-check.log")
    assert step.result["status"] == "passed" and step.result["summary"] == "3 passed in 1s"
    assert "===== noisy: passed" in (tmp_path / "gpu-check.log").read_text()
    assert "\x1b" not in (tmp_path / "gpu-check.log").read_text()
