"""The HDF5 trace (docs/design.md, Trace) of a short 4-rank run, and analyze.py on it."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import h5py
import numpy as np
import pytest
from test_train_runs import FAST, LIMIT, ROOT, mpi_command, run_train

from spar_comm.training.trace import EVAL, PHASES, TraceWriter, read_trace

ROOT_ATTRIBUTES = (
    "version", "created", "mpi_library", "world_size", "nodes", "ranks_per_node",
    "algorithm", "selector", "density", "config", "test_metric_name",
)
STEPS = 23


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A hitopk and a dense trace of the same short run on 4 ranks as 2 x 2."""
    folder = tmp_path_factory.mktemp("traces")
    paths = []
    for algorithm in ("hitopk", "dense"):
        path = folder / f"{algorithm}.h5"
        args = [*FAST, "--algorithm", algorithm, "--steps", str(STEPS), "--trace", str(path), "--ranks-per-node", "2"]
        result = run_train(4, args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.count("held-out accuracy") == 1  # rank 0 alone prints
        paths.append(path)
    return paths


@pytest.mark.slow
def test_trace_holds_every_dataset_and_attribute_of_the_design(traces):
    with h5py.File(traces[0], "r") as f:
        for name in ROOT_ATTRIBUTES:
            assert name in f.attrs, name
        config = json.loads(f.attrs["config"])
        assert config["algorithm"] == "hitopk" and config["steps"] == STEPS
        assert f.attrs["world_size"] == 4 and f.attrs["nodes"] == 2 and list(f.attrs["ranks_per_node"]) == [2, 2]
        assert f["hosts"].shape == (4,)
        for name in PHASES:
            assert f[f"phases/{name}"].shape == (STEPS, 4) and f[f"phases/{name}"].dtype == np.float64
        for name in ("intra", "inter"):
            assert f[f"bytes/{name}"].shape == (STEPS, 4) and f[f"bytes/{name}"].dtype == np.int64
        assert f["loss"].shape == f["lr"].shape == (STEPS,)
        assert f["k"].shape == f["threshold"].shape == (STEPS, 4)
        assert np.array_equal(f["step"][:], np.arange(STEPS))
        for name in EVAL:
            assert f[f"eval/{name}"].shape[0] >= 1
        assert f["eval/step"][-1] == STEPS
        assert (f["bytes/inter"][:] > 0).all() and (f["k"][:] > 0).all()
        phases = {name: f[f"phases/{name}"][:] for name in PHASES}
        inside = sum(phases[p] for p in PHASES if p != "step")
        assert (inside <= phases["step"] * 1.001 + 1e-6).all()


@pytest.mark.slow  # the traces come from two train.py runs of 4 ranks (8 s)
def test_a_resumed_trace_drops_the_rows_past_the_checkpoint(traces, tmp_path):
    copy = tmp_path / "copy.h5"
    copy.write_bytes(traces[0].read_bytes())
    TraceWriter(str(copy), {}, ["h"] * 4, resume_step=10).close()
    trace = read_trace(str(copy))
    assert trace.steps == 10 and trace.data["phases/step"].shape == (10, 4)
    assert (trace.data["eval/step"] <= 10).all()


@pytest.mark.slow  # the traces come from two train.py runs of 4 ranks (8 s)
def test_a_trace_whose_writer_died_can_be_resumed(traces, tmp_path):
    copy = tmp_path / "crashed.h5"
    copy.write_bytes(traces[0].read_bytes())
    crash = (
        "import os, signal, numpy as np\n"
        "from spar_comm.training.trace import FIELDS, TraceWriter\n"
        f"w = TraceWriter({str(copy)!r}, {{}}, ['h'] * 4, resume_step={STEPS})\n"
        f"w.append(np.array([{STEPS}]), np.ones((1, 4, len(FIELDS))))\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", crash], timeout=60).returncode == -signal.SIGKILL
    with pytest.raises(OSError):
        h5py.File(copy, "a").close()
    TraceWriter(str(copy), {}, ["h"] * 4, resume_step=STEPS - 3).close()
    trace = read_trace(str(copy))
    assert trace.steps == STEPS - 3 and trace.attrs["algorithm"] == "hitopk"
    with h5py.File(copy, "r") as f:  # whole again: no SWMR reader needed
        assert f["phases/step"].shape == (STEPS - 3, 4)


SUMMARY = re.compile(r"communication ([\d.]+) ms/step = (\d+)% of step time \(\+ select (\d+)%\) \| "
                     r"not counted: first step ([\d.]+) s, compiling ([\d.]+) s")


@pytest.mark.slow  # two train.py runs of 2 ranks, the first compiling into an empty cache
def test_the_summary_leaves_the_compiling_first_step_out(tmp_path):
    """The summary's shares are those of the trace's steps after the first,
    which compiles the kernels: on a cold cache, counting it would make
    selection (mstopk's, make train's) most of the step time."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    for cache in ("cold", "warm"):
        trace = tmp_path / f"{cache}.h5"
        args = [*FAST, "--selector", "mstopk", "--steps", "12", "--trace", str(trace), "--ranks-per-node", "1"]
        run = subprocess.run(mpi_command(2, args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=LIMIT)
        assert run.returncode == 0, run.stderr
        found = SUMMARY.search(run.stdout)
        assert found, run.stdout
        comm_ms, comm_share, select_share, first_s, compile_s = map(float, found.groups())
        with h5py.File(trace, "r") as f:
            step, select = f["phases/step"][:], f["phases/select"][:]
            comm = f["phases/comm_intra"][:] + f["phases/comm_inter"][:]
        assert abs(select_share - 100 * select[1:].mean() / step[1:].mean()) <= 0.5 + 1e-9
        assert abs(comm_share - 100 * comm[1:].mean() / step[1:].mean()) <= 0.5 + 1e-9
        assert abs(comm_ms - 1e3 * comm[1:].mean()) <= 0.005 + 1e-9
        assert abs(first_s - step[0].mean()) <= 0.005 + 1e-9
        if cache == "cold":  # the first step compiled its selection: counted, it would dominate the share
            assert 0 < compile_s < first_s
            assert select[0].min() > 10 * select[1:].max()
            assert 100 * select.mean() / step.mean() > select_share + 10
        else:  # loaded from the cache: nothing compiled
            assert compile_s == 0


def analyze(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "drivers/analyze.py", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # the traces come from two train.py runs of 4 ranks (8 s)
def test_analyze_prints_the_breakdown_and_the_comparison(traces):
    result = analyze(*map(str, traces))
    assert result.returncode == 0, result.stderr
    for needle in ("comm_inter", "median ms", "p95 ms", "slowest rank", "bytes/step", "steps/s", "side by side", "hitopk/exact"):
        assert needle in result.stdout


@pytest.mark.slow
def test_analyze_writes_json_png_and_chrome_events(traces, tmp_path):
    png, chrome = tmp_path / "b.png", tmp_path / "c.json"
    result = analyze(*map(str, traces), "--json", "--plot", str(png), "--chrome", str(chrome), "--steps", "5:8")
    assert result.returncode == 0, result.stderr
    figures = json.loads(result.stdout)["traces"]
    assert [t["algorithm"] for t in figures] == ["hitopk", "dense"]
    assert figures[0]["steps"] == 3 and figures[0]["phases"]["step"]["p95"] > 0
    assert figures[1]["bytes_per_step"]["inter"] > figures[0]["bytes_per_step"]["inter"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(chrome.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert {e["args"]["step"] for e in spans} == {5, 6, 7}
    assert len({(e["pid"], e["tid"]) for e in spans}) == 4 * 8  # a track per rank and phase


@pytest.mark.slow  # the traces come from two train.py runs of 4 ranks (8 s)
def test_analyze_follow_ends_when_the_run_is_complete(traces):
    result = analyze(str(traces[0]), "--follow", "--interval", "0.1")
    assert result.returncode == 0 and f"step {STEPS}/{STEPS}" in result.stdout


def test_analyze_refuses_a_missing_trace():
    result = analyze("no/such/trace.h5")
    assert result.returncode == 2 and "no such trace" in result.stderr
