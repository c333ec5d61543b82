"""drivers/bench_topk.py: the CPU table, the GPU benchmark's code under the
simulator (every device kernel, recall 1 against the exact set), and the
refusal of --device gpu where there is none."""
from __future__ import annotations

import json

import pytest


@pytest.mark.slow
def test_every_cpu_method_is_timed_against_its_baselines_and_is_exact(run_driver, tmp_path):
    out = tmp_path / "topk.json"
    result = run_driver("bench_topk.py", "--sizes", "20000", "--densities", "0.01", "--repeat", "2",
                        "--dtype", "float32,float16", "--no-torch", "--out", out)
    assert result.returncode == 0, result.stderr
    records = json.loads(out.read_text())["records"]
    for dtype in ("float32", "float16"):
        mine = {r["method"]: r for r in records if r["dtype"] == dtype}
        assert {"argpartition", "floor", "exact", "mstopk", "threshold"} <= set(mine)
        assert all(r["recall"] == 1.0 for r in mine.values() if r["exact"])
        assert mine["argpartition"]["speedup_vs_reference"] == 1.0 and mine["floor"]["floor_multiple"] == 1.0
        for r in mine.values():
            assert r["read_gbps"] == pytest.approx(20000 * (4 if dtype == "float32" else 2) / r["median_s"] / 1e9)


@pytest.mark.slow
def test_the_gpu_benchmark_runs_every_device_kernel_under_the_simulator(run_driver, tmp_path):
    pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")
    out = tmp_path / "gpu.json"
    result = run_driver("bench_topk.py", "--device", "gpu-simulator", "--sizes", "1500", "--densities", "0.01",
                        "--repeat", "1", "--out", out, env={"NUMBA_ENABLE_CUDASIM": "1"}, timeout=300)
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    methods = {r["method"]: r for r in document["records"]}
    assert set(methods) == {"argpartition", "floor", "exact", "mstopk", "threshold", "threshold_warm"}
    assert all(r["recall"] == 1.0 and r["device"] == "gpu-simulator" for r in methods.values() if r["exact"])
    assert all(r["matches_reference"] for r in methods.values() if r["exact"])  # the positions, not only the set
    assert document["machine"]["device"] == "gpu-simulator"


@pytest.mark.slow
def test_gpu_without_cupy_or_a_gpu_exits_2_naming_what_is_missing(run_driver):
    result = run_driver("bench_topk.py", "--device", "gpu", "--sizes", "1000")
    assert result.returncode == 2
    assert "--device gpu: needs CuPy and a GPU" in result.stderr


def test_the_gpu_only_options_are_refused_elsewhere(run_driver, tmp_path):
    for option in (["--graphs"], ["--cub-topk", str(tmp_path / "missing.so")]):
        result = run_driver("bench_topk.py", "--sizes", "1000", *option)
        assert result.returncode == 2 and "need --device gpu" in result.stderr, result.stderr
    library = tmp_path / "libcub_topk.so"
    result = run_driver("bench_topk.py", "--device", "gpu", "--sizes", "1000", "--cub-topk", library)
    assert result.returncode == 2 and f"--cub-topk: no such file '{library}'" in result.stderr, result.stderr


def test_bench_select_steps_without_a_gpu_exits_2_naming_what_is_missing(run_driver):
    result = run_driver("bench_select_steps.py", "--sizes", "1000")
    assert result.returncode == 2
    assert "bench_select_steps.py: needs CuPy and a GPU" in result.stderr, result.stderr
