"""drivers/train.py under mpiexec, launched as a subprocess with a hard time
limit: bit-identical resume, clean stops, bad input, and failures that end
the whole job instead of hanging it."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import h5py
import numpy as np
import pytest

from spar_comm.training.trace import read_trace

from conftest import ROOT, find_mpiexec

MPIEXEC = find_mpiexec()
#: Small and fast: the MLP on digits with the exact selector (every method is tested elsewhere).
FAST = ["--selector", "exact", "--no-progress", "--trace-every", "5", "--hidden", "32"]
LIMIT = 120  # seconds: a hang fails the test instead of the suite


def mpi_command(n: int, args: List[str], script: str = "drivers/train.py") -> List[str]:
    return [MPIEXEC, "-n", str(n), sys.executable, script, *args]


def run_train(n: int, args: List[str], script: str = "drivers/train.py") -> subprocess.CompletedProcess:
    """Run train.py (or a wrapper of it) on n ranks and return the finished process."""
    return subprocess.run(mpi_command(n, args, script), cwd=ROOT, capture_output=True, text=True, timeout=LIMIT)


def datasets(path: Path) -> dict:
    """Every dataset of an HDF5 file; of a checkpoint, its parts' too (read
    with h5py alone, as residuals/rank<r> and aids/velocity/rank<r>), and
    not the manifest, which names one save's files."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.update({name: obj[...]}) if isinstance(obj, h5py.Dataset) else None)
        token = f["parts"].attrs["token"] if "parts" in f else None
    if token is not None:
        token = token.decode() if isinstance(token, bytes) else token
        for part in sorted(Path(f"{path}.parts", token).glob("rank*.h5")):
            with h5py.File(part, "r") as f:
                found[f"residuals/{part.stem}"] = f["residual"][...]
                if "aids" in f:
                    found[f"aids/velocity/{part.stem}"] = f["aids/velocity"][...]
    return {name: values for name, values in found.items() if not name.startswith("parts/")}


@pytest.mark.slow
def test_the_gpu_path_trains_to_the_bits_of_the_cpu(tmp_path):
    """--device gpu-simulator: the allreduce on the GPU path (device kernels
    under the simulator, MPI through host staging) ends with the checkpoint of
    the CPU run, residuals included (the MLP computes in NumPy on both)."""
    common = [*FAST, "--selector", "threshold", "--steps", "6", "--ranks-per-node", "1", "--trace", ""]
    runs = {}
    for device in ("cpu", "gpu-simulator"):
        result = run_train(2, [*common, "--device", device, "--checkpoint", str(tmp_path / f"{device}.h5")])
        assert result.returncode == 0, result.stderr
        runs[device] = datasets(tmp_path / f"{device}.h5")
    cpu, gpu = runs["cpu"], runs["gpu-simulator"]
    assert sorted(cpu) == sorted(gpu) and "residuals/rank1" in cpu
    for name in cpu:
        assert np.array_equal(cpu[name], gpu[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("ranks, ranks_per_node, algorithm", [(2, 1, "hitopk"), (3, 2, "gtopk"), (2, 2, "powersgd")])
def test_stop_after_then_resume_gives_the_same_bits(tmp_path, ranks, ranks_per_node, algorithm):
    common = [*FAST, "--steps", "40", "--ranks-per-node", str(ranks_per_node), "--algorithm", algorithm, "--trace", ""]
    full = run_train(ranks, [*common, "--checkpoint", str(tmp_path / "full.h5")])
    assert full.returncode == 0, full.stderr
    first = run_train(ranks, [*common, "--checkpoint", str(tmp_path / "part.h5"), "--stop-after", "20"])
    assert first.returncode == 0, first.stderr
    assert "stopped by --stop-after at step 20" in first.stdout
    with h5py.File(tmp_path / "part.h5") as f:
        assert f.attrs["step"] == 20
    second = run_train(ranks, [*common, "--checkpoint", str(tmp_path / "part.h5"), "--resume"])
    assert second.returncode == 0, second.stderr
    a, b = datasets(tmp_path / "full.h5"), datasets(tmp_path / "part.h5")
    assert sorted(a) == sorted(b)
    assert {"params/layer0.weight", "optimizer/velocity/layer0.weight"} <= set(a)
    assert {f"residuals/rank{r}" for r in range(ranks)} <= set(a)
    assert ("allreducer/shared" in a) == (algorithm == "powersgd")  # PowerSGD's warm start Q
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert full.stdout.split("|")[0] == second.stdout.split("|")[0]  # the same held-out accuracy


def saved_totals(path: Path) -> dict:
    """The serial model of what a checkpoint's residuals and aids' velocities
    hold in all: every saved rank's values added into the whole vector in
    rank order, in float32 (read with h5py alone)."""
    found = datasets(path)
    size = sum(values.size for name, values in found.items() if name.startswith("params/"))
    totals = {"residuals": np.zeros(size, np.float32), "aids/velocity": np.zeros(size, np.float32)}
    with h5py.File(path, "r") as f:
        token = f["parts"].attrs["token"]
    for part in sorted(Path(f"{path}.parts", token.decode() if isinstance(token, bytes) else token).glob("rank*.h5"),
                       key=lambda p: int(p.stem[len("rank"):])):
        with h5py.File(part, "r") as f:
            lo, hi = f["residual"].attrs["lo"], f["residual"].attrs["hi"]
            totals["residuals"][lo:hi] += f["residual"][...]
            totals["aids/velocity"] += f["aids/velocity"][...]
    return totals


@pytest.mark.slow
@pytest.mark.parametrize("before, after, algorithm", [((4, 2), (2, 2), "hitopk"), ((2, 1), (4, 1), "topka"),
                                                      ((4, 2), (4, 1), "hitopk"), ((4, 2), (4, 1), "topka")])
def test_a_resume_on_another_world_keeps_what_the_residuals_hold_in_all(tmp_path, before, after, algorithm):
    """4 -> 2 ranks, 2 -> 4, and 2 x 2 -> 4 x 1 (where topka's residuals
    span the whole vector on both worlds: the layout tells them apart): the
    resumed run's first checkpoint (it has no step left to take) holds the
    saved totals, bit for bit."""
    common = [*FAST, "--steps", "10", "--trace", "", "--algorithm", algorithm, "--density", "0.05"]
    ck = tmp_path / "ck.h5"
    first = run_train(before[0], [*common, "--ranks-per-node", str(before[1]), "--checkpoint", str(ck)])
    assert first.returncode == 0, first.stderr
    saved, kept = saved_totals(ck), datasets(ck)
    assert saved["residuals"].any() and saved["aids/velocity"].any()
    second = run_train(after[0], [*common, "--ranks-per-node", str(after[1]), "--checkpoint", str(ck), "--resume"])
    assert second.returncode == 0, second.stderr
    assert (f"resuming {ck}, saved by {before[0]} ranks (nodes of {[before[1]] * (before[0] // before[1])}), "
            f"on {after[0]} ranks") in second.stdout
    resumed = saved_totals(ck)
    for name in saved:
        assert resumed[name].tobytes() == saved[name].tobytes(), name
    now = datasets(ck)
    assert sorted(name for name in now if name.startswith("residuals/")) == [f"residuals/rank{r}" for r in range(after[0])]
    for name in kept:
        if name.startswith(("params/", "optimizer/", "schedule/")):
            assert now[name].tobytes() == kept[name].tobytes(), name


@pytest.mark.slow
def test_a_resume_on_another_world_still_checks_the_settings(tmp_path):
    ck = tmp_path / "ck.h5"
    common = [*FAST, "--steps", "4", "--trace", "", "--checkpoint", str(ck)]
    assert run_train(2, common).returncode == 0
    result = run_train(1, [*common, "--resume", "--lr", "0.3", "--ranks-per-node", "1"])
    assert result.returncode == 2 and "settings differ" in result.stderr, result.stderr
    assert "lr: 0.05 -> 0.3" in result.stderr and "ranks_per_node" not in result.stderr, result.stderr


@pytest.mark.slow
def test_resume_with_the_aids_crosses_a_density_rebuild_to_the_same_bits(tmp_path):
    """Momentum correction, masking, clipping and a density warm-up: the run stops
    between two rebuilds of the allreducer and resumes to the bits of one that
    never stopped; the trace records the density of every step."""
    steps_per_epoch = 1437 // 3 // 32  # digits: 1,437 training samples at 3 ranks
    common = [*FAST, "--steps", "50", "--ranks-per-node", "2", "--algorithm", "hitopk", "--density", "0.001",
              "--density-warmup", "3", "--clip-norm", "5", "--momentum-masking"]
    full = run_train(3, [*common, "--trace", "", "--checkpoint", str(tmp_path / "full.h5")])
    assert full.returncode == 0, full.stderr
    trace = str(tmp_path / "t.h5")
    first = run_train(3, [*common, "--trace", trace, "--checkpoint", str(tmp_path / "part.h5"), "--stop-after", "20"])
    assert first.returncode == 0, first.stderr
    second = run_train(3, [*common, "--trace", trace, "--checkpoint", str(tmp_path / "part.h5"), "--resume"])
    assert second.returncode == 0, second.stderr
    a, b = datasets(tmp_path / "full.h5"), datasets(tmp_path / "part.h5")
    assert sorted(a) == sorted(b) and {f"aids/velocity/rank{r}" for r in range(3)} <= set(a)
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert a["aids/velocity/rank1"].any()
    density = read_trace(trace).data["density"]
    expected = [0.25 * (0.001 / 0.25) ** min(step // steps_per_epoch / 3, 1) for step in range(50)]
    np.testing.assert_allclose(density, expected, rtol=1e-12)
    assert len(set(density)) == 4  # rebuilds at steps 14, 28 and 42; the stop at 20 falls between two


@pytest.mark.slow
def test_an_accordion_run_switches_density_and_resumes_mid_epoch_to_the_same_bits(tmp_path):
    """Accordion's state (the epoch's accumulated update, the last norm, the
    density) goes through the checkpoint: a run stopped inside an epoch resumes
    to the bits of one that never stopped, densities included."""
    steps_per_epoch = 1437 // 2 // 32  # 22: digits' 1,437 training samples at 2 ranks
    common = [*FAST, "--steps", str(4 * steps_per_epoch), "--ranks-per-node", "1", "--algorithm", "hitopk",
              "--density", "0.01", "--density-schedule", "accordion"]
    full_trace, trace = str(tmp_path / "full_t.h5"), str(tmp_path / "t.h5")
    full = run_train(2, [*common, "--trace", full_trace, "--checkpoint", str(tmp_path / "full.h5")])
    assert full.returncode == 0, full.stderr
    assert "(accordion: 0.1 in critical regimes, eta 0.5)" in full.stdout
    first = run_train(2, [*common, "--trace", trace, "--checkpoint", str(tmp_path / "part.h5"), "--stop-after", "50"])
    assert first.returncode == 0, first.stderr
    with h5py.File(tmp_path / "part.h5") as f:
        assert f["schedule/accumulated"].shape == (sum(p.size for p in f["params"].values()),)
    second = run_train(2, [*common, "--trace", trace, "--checkpoint", str(tmp_path / "part.h5"), "--resume"])
    assert second.returncode == 0, second.stderr
    a, b = datasets(tmp_path / "full.h5"), datasets(tmp_path / "part.h5")
    assert sorted(a) == sorted(b) and "schedule/accumulated" in a
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    density = read_trace(full_trace).data["density"]
    assert np.array_equal(read_trace(trace).data["density"], density)
    by_epoch = [set(density[e * steps_per_epoch:(e + 1) * steps_per_epoch].tolist()) for e in range(4)]
    assert all(len(d) == 1 for d in by_epoch), by_epoch  # decided once an epoch
    assert by_epoch[0] == by_epoch[1] == {0.1}  # critical at the start: no earlier norm to compare with
    assert by_epoch[2] == {0.01}  # the stop at step 50 falls inside the first epoch at the target


@pytest.mark.slow
def test_index_codecs_are_lossless_and_value_codecs_resume_to_the_same_bits(tmp_path):
    """--indices auto gives the bits of int32 positions; an int8 run stopped and
    resumed gives the bits of one that never stopped (the rounding lives in
    the residual, which the checkpoint keeps)."""
    common = [*FAST, "--steps", "40", "--ranks-per-node", "1", "--algorithm", "hitopk", "--density", "0.05",
              "--values", "int8", "--trace", ""]
    plain = run_train(2, [*common, "--checkpoint", str(tmp_path / "plain.h5")])
    auto = run_train(2, [*common, "--indices", "auto", "--checkpoint", str(tmp_path / "auto.h5")])
    assert plain.returncode == 0 and auto.returncode == 0, plain.stderr + auto.stderr
    assert "int8 values, auto indices" in auto.stdout
    first = run_train(2, [*common, "--checkpoint", str(tmp_path / "part.h5"), "--stop-after", "17"])
    second = run_train(2, [*common, "--checkpoint", str(tmp_path / "part.h5"), "--resume"])
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    a, b, c = (datasets(tmp_path / name) for name in ("plain.h5", "auto.h5", "part.h5"))
    assert sorted(a) == sorted(b) == sorted(c)
    for name in a:
        assert np.array_equal(a[name], b[name]) and np.array_equal(a[name], c[name]), name


@pytest.mark.slow
def test_resume_refuses_changed_settings(tmp_path):
    ckpt = str(tmp_path / "c.h5")
    assert run_train(2, [*FAST, "--steps", "5", "--trace", "", "--checkpoint", ckpt]).returncode == 0
    before = Path(ckpt).read_bytes()
    again = run_train(2, [*FAST, "--steps", "5", "--trace", "", "--checkpoint", ckpt, "--resume", "--lr", "0.3"])
    assert again.returncode == 2
    assert again.stderr.count("settings differ from the checkpoint's (lr: 0.05 -> 0.3)") == 1
    assert Path(ckpt).read_bytes() == before


@pytest.mark.parametrize(
    "args, message",
    [
        (["--density", "0"], "--density must be in (0, 1]"),
        (["--algorithm", "nope"], "invalid choice: 'nope'"),
        (["--epochs", "2", "--steps", "3"], "not allowed with argument"),
        (["--batch-size", "100000"], "larger than a rank's share"),
        (["--selector", "nope"], "unknown selector 'nope'"),
        (["--resume", "--checkpoint", "missing.h5"], "no checkpoint to resume"),
        (["--device", "gpu"], "--device gpu: "),  # no CuPy, or no GPU, on this machine
        (["--trace", "/proc/no/such/t.h5"], "cannot write the trace /proc/no/such/t.h5"),
    ],
)
@pytest.mark.slow
def test_bad_input_exits_2_with_one_message_and_keeps_the_trace(tmp_path, args, message):
    trace = tmp_path / "t.h5"
    trace.write_bytes(b"an earlier run's trace")
    result = run_train(2, [*FAST, "--trace", str(trace), *args])
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(message) == 1, result.stderr
    assert result.stderr.count("usage: train.py") == 1
    assert trace.read_bytes() == b"an earlier run's trace"


def failing_job(folder: Path, rank: int, call: int, args: List[str]) -> Path:
    """A wrapper of train.py whose ``rank`` raises in its ``call``-th gradient."""
    wrapper = folder / "failing_train.py"
    wrapper.write_text(
        "import runpy, sys\n"
        "from mpi4py import MPI\n"
        "from spar_comm.training import models\n"
        "original = models.MLP.loss_and_grad\n"
        "calls = [0]\n"
        "def failing(self, params, batch):\n"
        "    calls[0] += 1\n"
        f"    if MPI.COMM_WORLD.rank == {rank} and calls[0] == {call}:\n"
        "        raise RuntimeError('injected failure')\n"
        "    return original(self, params, batch)\n"
        "models.MLP.loss_and_grad = failing\n"
        f"sys.argv = ['train.py'] + {args!r}\n"
        "runpy.run_path('drivers/train.py', run_name='__main__')\n"
    )
    return wrapper


@pytest.mark.openmpi
@pytest.mark.slow
def test_an_exception_on_one_rank_ends_the_job_once(tmp_path):
    wrapper = failing_job(tmp_path, rank=1, call=5, args=[*FAST, "--trace", "", "--steps", "50"])
    result = run_train(3, [], script=str(wrapper))
    assert result.returncode != 0
    assert result.stderr.count("RuntimeError: injected failure") == 1, result.stderr
    assert "[rank 1] train.py failed:" in result.stderr


@pytest.mark.openmpi
@pytest.mark.slow
def test_a_crashed_run_resumes_from_its_last_periodic_checkpoint(tmp_path):
    common = [*FAST, "--steps", "40", "--ranks-per-node", "1"]
    full = run_train(2, [*common, "--trace", "", "--checkpoint", str(tmp_path / "full.h5")])
    assert full.returncode == 0, full.stderr
    ckpt, trace = str(tmp_path / "c.h5"), str(tmp_path / "t.h5")
    args = [*common, "--checkpoint", ckpt, "--checkpoint-every", "15", "--trace", trace]
    crashed = run_train(2, [], script=str(failing_job(tmp_path, rank=0, call=23, args=args)))
    assert crashed.returncode != 0
    with h5py.File(ckpt) as f:
        assert f.attrs["step"] == 15
    resumed = run_train(2, [*args, "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    a, b = datasets(tmp_path / "full.h5"), datasets(Path(ckpt))
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    assert np.array_equal(read_trace(trace).data["step"], np.arange(40))


@pytest.mark.openmpi
@pytest.mark.slow
def test_sigusr1_stops_every_rank_at_one_step_with_a_checkpoint(tmp_path):
    ckpt, trace = tmp_path / "c.h5", tmp_path / "t.h5"
    args = [*FAST, "--epochs", "10000", "--checkpoint", str(ckpt), "--trace", str(trace)]
    job = subprocess.Popen(mpi_command(2, args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(trace, job)
        ranks = _rank_pids(job.pid)
        os.kill(ranks[-1], signal.SIGUSR1)  # one rank alone: the others must follow it
        out, err = job.communicate(timeout=LIMIT)
    finally:
        job.kill()
    assert job.returncode == 0, err
    assert "stopped by signal" in out
    with h5py.File(ckpt) as f:
        step = int(f.attrs["step"])
    with h5py.File(trace) as f:
        assert f["step"][-1] == step - 1 and len(f["step"]) == step


@pytest.mark.openmpi
@pytest.mark.slow
def test_sigkill_of_a_rank_ends_the_job_and_keeps_the_trace(tmp_path):
    trace = tmp_path / "t.h5"
    args = [*FAST, "--epochs", "10000", "--trace", str(trace)]
    job = subprocess.Popen(mpi_command(3, args), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_steps(trace, job)
        os.kill(_rank_pids(job.pid)[-1], signal.SIGKILL)
        job.communicate(timeout=60)
    finally:
        job.kill()
    assert job.returncode != 0
    # The writer died with the file open: readers open it as SWMR readers do (or after `h5clear -s`).
    kept = read_trace(str(trace))
    assert kept.steps >= 10 and np.array_equal(kept.data["step"], np.arange(kept.steps))
    assert kept.data["phases/step"].shape == (kept.steps, 3)


def _wait_for_steps(trace: Path, job: subprocess.Popen, steps: int = 10) -> None:
    """Until the live trace (read as SWMR) holds ``steps`` steps."""
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        assert job.poll() is None, job.communicate()
        try:
            with h5py.File(trace, "r", libver="latest", swmr=True) as f:
                if len(f["step"]) >= steps:
                    return
        except (OSError, KeyError):
            pass
        time.sleep(0.2)
    raise AssertionError("the run wrote no trace in time")


def _rank_pids(launcher: int) -> List[int]:
    """The train.py processes that mpiexec started: its grandchildren through
    MPICH's proxy, its children under Open MPI's prterun."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout
    rows = [line.split(None, 2) for line in out.splitlines()]
    below, found = {launcher}, True
    while found:
        found = {int(p) for p, pp, _ in rows if int(pp) in below} - below
        below |= found
    return sorted(int(p) for p, _, args in rows if int(p) in below - {launcher} and "train.py" in args)
