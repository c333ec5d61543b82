"""spar_comm.torch under torchrun, where every process's MPI world is a world
of one: each way in refuses with ConfigError on every rank, naming both
worlds, before a gradient is touched (never a silent reduction over one rank);
a torchrun job of one rank, whose MPI world is its world, runs. Each launch
has a hard time limit and leaves no process behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from run_mpi import kill_marked

torch = pytest.importorskip("torch")
SCRIPT = ROOT / "tests" / "torchrun_worlds.py"
CALLS = ["rank", "size", "local_device", "init_process_group", "broadcast_parameters", "broadcast_optimizer_state",
         "DistributedOptimizer", "comm_hook"]


def torchrun(ranks: int, *args: str, limit: float = 90) -> dict:
    """The script's lines under ``torchrun --nproc-per-node ranks``, by rank and call."""
    marker = f"torchrun-{os.getpid()}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--standalone", str(SCRIPT), *args]
    env = dict(os.environ, SPAR_COMM_TEST_LAUNCH=marker, OMP_NUM_THREADS="1")
    env.pop("WORLD_SIZE", None)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        kill_marked(marker)
        output, _ = process.communicate()
        pytest.fail(f"torchrun did not end within {limit} s:\n{output[-3000:]}")
    assert process.returncode == 0, output[-3000:]
    lines: dict = {}
    for line in output.splitlines():
        if line.startswith("rank "):
            rank, name, outcome = line.split(": ", 2)
            lines[(int(rank.split()[1]), name)] = outcome
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("init", [True, False], ids=["torch.distributed initialised", "only torchrun's WORLD_SIZE"])
def test_every_way_in_refuses_a_world_of_one_on_every_rank(init):
    lines = torchrun(2, *(["--init"] if init else []))
    source = "torch.distributed's default group" if init else "WORLD_SIZE=2, as torchrun sets it"
    for rank in range(2):
        for call in CALLS:
            outcome = lines.get((rank, call), "(no line)")
            if init and call == "init_process_group":
                assert outcome == "ConfigError: torch.distributed is already initialised", outcome
                continue
            assert outcome.startswith("ConfigError: spar_comm.torch."), (rank, call, outcome)
            assert f"MPI's world of 1 rank, but this torch job has 2 ({source})" in outcome, (rank, call, outcome)
            assert "mpiexec -n 2" in outcome, outcome
        assert (rank, "gradient") not in lines  # no DDP step ran on a hook over a world of one


@pytest.mark.slow
def test_a_torchrun_job_of_one_rank_is_its_own_world():
    lines = torchrun(1, "--init")
    for call in CALLS:
        expected = "ConfigError: torch.distributed is already initialised" if call == "init_process_group" else "ran"
        assert lines.get((0, call)) == expected, (call, lines)
    # one rank's mean is its own gradient: the input 1.0, six weights
    assert lines.get((0, "gradient")) == repr(6.0), lines
