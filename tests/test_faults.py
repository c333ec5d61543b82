"""Faults end the job, never hang it: a stalled rank meets the deadline
(SPAR_COMM_TIMEOUT), a signal ends a rank stuck in a collective, a full disk
under the checkpoint is an error naming it. Every job runs under a hard
limit; the processes it leaves (counted by a marker in their environment)
and MPI's /dev/shm files it leaves must be none."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

import h5py
import numpy as np
import pytest

from conftest import ROOT, two_emulated_hosts
from shm_cleanup import mpi_segments, orphaned_segments
from spar_comm import emucluster, waiting
from test_train_runs import FAST, _wait_for_steps, datasets, mpi_command, run_train

pytestmark = pytest.mark.alone  # it times deadlines and counts the /dev/shm files a job leaves

#: SPAR_COMM_TIMEOUT of the jobs, seconds.
TIMEOUT = 4
#: A job past this many seconds is killed and the test fails.
LIMIT = 120
MARK = "SPAR_COMM_FAULT_TEST"


class Job:
    """A train.py job marked in its environment, so that every process it
    starts can be found, counted and, if the test fails, killed."""

    def __init__(self, ranks: int, args: List[str], timeout: float = TIMEOUT):
        self.marker = f"{os.getpid()}-{time.monotonic_ns()}"
        self.segments = mpi_segments()
        env = dict(os.environ, **{MARK: self.marker, waiting.ENV_TIMEOUT: str(timeout)})
        self.process = subprocess.Popen(mpi_command(ranks, args), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True, start_new_session=True)

    def processes(self) -> Dict[int, Dict[str, str]]:
        """Every live process of the job: pid -> its environment."""
        found = {}
        needle = f"{MARK}={self.marker}".encode()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as environ:
                    variables = environ.read().split(b"\0")
            except OSError:
                continue
            if needle in variables:
                found[int(pid)] = dict(v.decode(errors="replace").split("=", 1) for v in variables if b"=" in v)
        return found

    def rank(self, rank: int) -> int:
        """The pid of train.py's rank ``rank``."""
        pids = [pid for pid, env in self.processes().items() if env.get("PMI_RANK") == str(rank)]
        assert len(pids) == 1, pids
        return pids[0]

    def end(self, since: float) -> tuple:
        """Wait for the launcher and for the last process of the job: (status,
        stdout, stderr, seconds from ``since`` until no process was left)."""
        out, err = self.process.communicate(timeout=LIMIT)
        while self.processes() and time.monotonic() < since + LIMIT:
            time.sleep(0.05)
        return self.process.returncode, out, err, time.monotonic() - since

    def kill(self) -> None:
        """What a failed test leaves: SIGKILL to every process of the job."""
        for pid in self.processes():
            with _gone():
                os.kill(pid, signal.SIGKILL)
        self.process.kill()
        self.process.communicate()

    def assert_nothing_left(self) -> None:
        assert self.processes() == {}, "processes left"
        assert orphaned_segments(self.segments) == set(), "MPI's shared memory files left in /dev/shm"


class _gone:
    """Ignore a process that ended meanwhile."""

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind, *_) -> bool:
        return kind is ProcessLookupError


def saved_step(checkpoint: Path) -> int:
    """The step of the checkpoint, or -1 while there is none."""
    try:
        with h5py.File(checkpoint) as f:
            return int(f.attrs["step"])
    except (OSError, KeyError):
        return -1


def resumes_to_the_same_bits(tmp_path: Path, ckpt: Path, args: List[str], ranks_per_node: int = 1) -> int:
    """Assert that a fault's last checkpoint, resumed on 2 ranks in the
    faulted job's layout and run 10 steps on, holds the bits of a run never
    interrupted, stopped at the same step. Returns the step the checkpoint held."""
    step = saved_step(ckpt)
    assert step >= 10, f"the fault left a checkpoint of step {step}"
    common = [*_without(args, "--checkpoint", "--trace", "--ranks-per-node"), "--ranks-per-node",
              str(ranks_per_node), "--trace", "", "--stop-after", str(step + 10)]
    resumed = run_train(2, [*common, "--checkpoint", str(ckpt), "--resume"])
    assert resumed.returncode == 0, resumed.stderr
    fresh = tmp_path / "uninterrupted.h5"
    whole = run_train(2, [*common, "--checkpoint", str(fresh)])
    assert whole.returncode == 0, whole.stderr
    a, b = datasets(fresh), datasets(ckpt)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(a[name], b[name]), name
    return step


def _without(args: List[str], *options: str) -> List[str]:
    """``args`` less each of ``options`` and its value."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        else:
            kept.append(arg)
    return kept


def report(fault: str, seconds: Optional[float], left: int, trace: Path, step: int) -> None:
    """One row of the faults' table (docs/results/faults.md), seen with
    ``pytest -s``: the seconds from the fault until the job's last process was
    gone (None: the run itself found the fault, and ended with an error), the
    processes left, the steps the trace saw past the checkpoint (which a
    resume repeats; at least that many, since the trace is written every few
    steps and not at all by a rank killed), and the checkpoint's step,
    resumed to the same bits."""
    with h5py.File(trace, "r", libver="latest", swmr=True) as f:
        lost = int(f["step"][-1]) - step
    ended = "an error at once" if seconds is None else f"{seconds:.1f} s"
    print(f"\n| {fault} | {ended} | {left} | {'at least ' if lost > 0 else ''}{max(lost, 0)} | "
          f"yes, from step {step} |")


def running(tmp_path: Path, ranks: int = 2, timeout: float = TIMEOUT, ranks_per_node: int = 1) -> tuple:
    """A long run with a periodic checkpoint, once its trace holds some steps: (job, checkpoint, its arguments).
    Nodes of 2 ranks share memory windows: MPI's files in /dev/shm."""
    ckpt, trace = tmp_path / "c.h5", tmp_path / "t.h5"
    args = [*FAST, "--epochs", "10000", "--ranks-per-node", str(ranks_per_node), "--checkpoint", str(ckpt),
            "--checkpoint-period", "0.3", "--trace", str(trace)]
    job = Job(ranks, args, timeout)
    try:
        _wait_for_steps(trace, job.process)
        while saved_step(ckpt) < 10:  # a periodic checkpoint after the first steps
            assert job.process.poll() is None, job.process.communicate()
            time.sleep(0.1)
    except BaseException:
        job.kill()
        raise
    return job, ckpt, args


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_at_the_deadline_and_it_resumes_to_the_same_bits(tmp_path):
    job, ckpt, args = running(tmp_path)
    try:
        os.kill(job.rank(1), signal.SIGSTOP)
        fault = time.monotonic()
        status, _, err, seconds = job.end(fault)
    finally:
        job.kill()
    assert status == waiting.EXIT_TIMEOUT, err
    assert "[rank 0] spar_comm: no answer past the deadline (SPAR_COMM_TIMEOUT=4)" in err, err
    assert "[rank 0] spar_comm: still waiting, half-way to the deadline" in err, err
    assert seconds < TIMEOUT + 4, f"the job ended {seconds:.1f} s after the fault"
    job.assert_nothing_left()
    step = resumes_to_the_same_bits(tmp_path, ckpt, args)
    report("one rank stopped (SIGSTOP)", seconds, len(job.processes()), tmp_path / "t.h5", step)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=lambda s: s.name)
def test_a_signal_ends_a_rank_stuck_in_a_collective(tmp_path, sig):
    job, ckpt, args = running(tmp_path, 2, 60, ranks_per_node=2)
    try:
        os.kill(job.rank(1), signal.SIGSTOP)
        time.sleep(0.5)  # rank 0 is now stuck waiting for rank 1
        os.kill(job.rank(0), sig)
        signalled = time.monotonic()
        status, _, err, seconds = job.end(signalled)
    finally:
        job.kill()
    assert status != 0, err
    if sig == signal.SIGTERM:  # handled by the clean stop, which a stuck rank never reaches: the watchdog ends it
        assert status == 128 + sig, err
        assert "[rank 0] spar_comm: SIGTERM while stuck:" in err, err
    assert seconds < waiting.SIGNAL_GRACE_S + 3, f"the job ended {seconds:.1f} s after the signal"
    job.assert_nothing_left()
    step = resumes_to_the_same_bits(tmp_path, ckpt, args, ranks_per_node=2)
    report(f"{sig.name} to a rank stuck in a collective", seconds, len(job.processes()), tmp_path / "t.h5", step)


@pytest.fixture
def small_disk(tmp_path, request):
    """A small file system, by default 160 KiB: room for one checkpoint of the
    FAST model, not for a second beside it."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    size = getattr(request, "param", "160k")
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


@pytest.mark.slow
def test_a_full_disk_under_the_checkpoint_is_an_error_on_every_rank_and_the_last_one_stays(tmp_path, small_disk):
    ckpt = small_disk / "c.h5"
    args = [*FAST, "--steps", "40", "--ranks-per-node", "1", "--checkpoint", str(ckpt), "--checkpoint-every", "10",
            "--trace", str(tmp_path / "t.h5")]
    result = run_train(2, args)
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("train.py: WriteError: rank 0: ")]
    assert len(errors) == 1 and f"the checkpoint {ckpt}: " in errors[0], result.stderr  # its file, or a rank's part
    assert "No space left on device" in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert saved_step(ckpt) == 10 and sorted(os.listdir(small_disk)) == ["c.h5", "c.h5.parts"]
    assert len(os.listdir(f"{ckpt}.parts")) == 1  # the failed save's parts are gone, the last one's stay
    kept = tmp_path / "kept.h5"  # resumed where there is room for the next checkpoint
    shutil.copy(ckpt, kept)
    shutil.copytree(f"{ckpt}.parts", f"{kept}.parts")
    step = resumes_to_the_same_bits(tmp_path, kept, args)  # the checkpoint left is whole
    report("a full disk under the checkpoint", None, 0, tmp_path / "t.h5", step)


@pytest.mark.slow
@pytest.mark.parametrize("small_disk", ["1200k"], indirect=True)
def test_a_full_disk_under_the_trace_is_an_error_on_every_rank_and_the_checkpoint_stays(tmp_path, small_disk):
    """The trace keeps 1 MiB spare: on 1200 KiB it is full after a few hundred steps."""
    trace, ckpt = small_disk / "t.h5", tmp_path / "c.h5"
    args = [*FAST, "--steps", "5000", "--trace-every", "1", "--ranks-per-node", "1", "--trace", str(trace),
            "--checkpoint", str(ckpt), "--checkpoint-every", "100"]
    result = run_train(2, args)
    assert result.returncode == 1, result.stderr
    assert result.stderr.count(f"train.py: WriteError: rank 0: cannot write the trace {trace}: ") == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    step = resumes_to_the_same_bits(tmp_path, ckpt, args)
    report("a full disk under the trace", None, 0, trace, step)


# -- on the emulated cluster: 2 hosts of 1 rank, TCP between them ------------------------
EMU_PREFIX = "spx"  # not the default, so a user's own cluster is never touched


@pytest.fixture
def hosts():
    yield from two_emulated_hosts(EMU_PREFIX)


def emulated_run(tmp_path: Path) -> tuple:
    """train.py on the emulated hosts through ``emucluster.py run``, just
    after it saved a periodic checkpoint past 10 steps, so that a fault now
    meets the ranks in training, not in the patient wait while rank 0 saves
    the next one: (launcher, checkpoint, train.py's arguments)."""
    ckpt, trace = tmp_path / "c.h5", tmp_path / "t.h5"
    args = [*FAST, "--epochs", "10000", "--checkpoint", str(ckpt), "--checkpoint-period", "1", "--trace", str(trace)]
    command = [sys.executable, "drivers/emucluster.py", "--prefix", EMU_PREFIX, "run", "--", sys.executable,
               "drivers/train.py", *args]
    env = dict(os.environ, **{waiting.ENV_TIMEOUT: str(TIMEOUT)})
    launcher = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    deadline = time.monotonic() + LIMIT
    while saved_step(ckpt) < 10:
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.2)
    last = saved_step(ckpt)
    while saved_step(ckpt) == last:  # the checkpoint period is 1 s
        assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()
        time.sleep(0.02)
    return launcher, ckpt, args


def run_processes(launcher: subprocess.Popen) -> List[int]:
    """The live processes of the job that ``emucluster.py run`` started (marked with its pid)."""
    prefix = f"{emucluster.RUN_MARK}={launcher.pid}-".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as environ:
                if any(v.startswith(prefix) for v in environ.read().split(b"\0")):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def job_ranks(pids: List[int]) -> List[int]:
    """The ranks (train.py's processes) among ``pids``, the job's live processes (``run_processes``)."""
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except OSError:
            continue
        if os.path.basename(argv[0]).startswith(b"python") and argv[1:2] == [b"drivers/train.py"]:
            found.append(pid)
    return found


def ended(launcher: subprocess.Popen, since: float) -> tuple:
    """(launcher's status, its stdout and stderr, seconds from ``since`` until no
    rank of the job was left, and until no process of it was left: the
    launcher's teardown may take longer than the ranks, and is MPICH's)."""
    output: Dict[str, str] = {}
    reader = threading.Thread(target=lambda: output.update(zip(("out", "err"), launcher.communicate())),
                              daemon=True)
    reader.start()
    ranks_gone = None
    try:
        while time.monotonic() < since + LIMIT:
            left = run_processes(launcher)
            if ranks_gone is None and not job_ranks(left):
                ranks_gone = time.monotonic() - since
            if not left and not reader.is_alive():
                return launcher.returncode, output["out"], output["err"], ranks_gone, time.monotonic() - since
            time.sleep(0.05)
        launcher.kill()
        reader.join(5)
        pytest.fail(f"the job ran {LIMIT} s past the fault: {output}")
    finally:
        launcher.kill()
        for pid in run_processes(launcher):  # a failed test's leftovers
            with _gone():
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=lambda s: s.name)
def test_the_launcher_killed_leaves_no_process(tmp_path, hosts, sig):
    segments = mpi_segments()
    launcher, ckpt, args = emulated_run(tmp_path)
    assert len(run_processes(launcher)) == 5  # mpiexec, a proxy per host, a rank per host
    launcher.send_signal(sig)
    status, out, err, _, seconds = ended(launcher, time.monotonic())
    assert seconds < 5, f"the job's last process ended {seconds:.1f} s after the launcher was signalled"
    assert run_processes(launcher) == []
    if sig == signal.SIGTERM:  # passed on to the ranks: the clean stop, with a checkpoint
        assert status == 0 and "stopped by signal" in out, err
        assert orphaned_segments(segments) == set()
    else:  # mpiexec ends the job as its launcher dies; MPI's own files are the harness's to remove
        assert status == -signal.SIGKILL
    step = resumes_to_the_same_bits(tmp_path, ckpt, args)
    report(f"the launcher killed ({sig.name})", seconds, len(run_processes(launcher)), tmp_path / "t.h5", step)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["down", "crawl"])
def test_a_link_taken_down_or_slowed_to_a_crawl_ends_the_job_at_the_deadline(tmp_path, hosts, fault):
    segments = mpi_segments()
    launcher, ckpt, args = emulated_run(tmp_path)
    assert len(job_ranks(run_processes(launcher))) == 2, run_processes(launcher)  # a rank per host, found as ranks
    if fault == "down":
        subprocess.run(["ip", "link", "set", hosts.veth(1), "down"], check=True)
    else:  # 1 kbit/s: a message of a step takes longer than the deadline
        emucluster.reshape(hosts, "1kbit", "0us")
    status, _, err, ranks_gone, seconds = ended(launcher, time.monotonic())
    assert status == waiting.EXIT_TIMEOUT, err
    assert "spar_comm: no answer past the deadline (SPAR_COMM_TIMEOUT=4)" in err, err
    # The ranks end past the deadline, by MPI_Abort or ABORT_GRACE_S later (4.3 s
    # after the link went down, 10 s after it slowed, on a quiet machine); the
    # launcher's own teardown then crosses the slowed link (the job's last process
    # seen 4.9 to 22 s after the fault on a loaded 2-core machine): that is MPICH's,
    # held to LIMIT by ``ended``. Hanging would take LIMIT, or PATIENCE_S.
    assert ranks_gone < 30, f"the job's last rank ended {ranks_gone:.1f} s after the link went down"
    assert run_processes(launcher) == []
    assert orphaned_segments(segments) == set()
    step = resumes_to_the_same_bits(tmp_path, ckpt, args)  # the last periodic checkpoint, whole
    what = "taken down" if fault == "down" else "slowed to 1 kbit/s"
    report(f"a host's link {what}", seconds, len(run_processes(launcher)), tmp_path / "t.h5", step)
