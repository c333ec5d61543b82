"""An elastic torchrun job on the emulated cluster loses a host and goes on.

drivers/train_ddp.py under ``torchrun --nnodes 1:2 --max-restarts 2`` on 2
emulated hosts of 1 rank (network namespaces, TCP between them): once a
checkpoint is committed, host 1's torchrun agent and its worker are killed,
or stopped (a host that hangs). The survivor's worker must notice and end, its agent restart
it on the host that is left (a world of 1), the run resume from the last
committed save, saying so in one line, and finish with status 0; no process
of the job may be left, nor an MPI shared-memory file. Each job runs under a
hard limit, and the times from the fault to the restart and to the end are
printed."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List

import pytest

from conftest import ROOT, two_emulated_hosts
from shm_cleanup import mpi_segments, orphaned_segments
from spar_comm import emucluster, waiting

pytestmark = pytest.mark.alone  # it times a deadline on an emulated cluster and counts /dev/shm files

EMU_PREFIX = "spe"  # not the default, so a user's own cluster is never touched
PORT = 29511
#: SPAR_COMM_TIMEOUT of the workers, seconds: a wait on the dead peer ends by then.
TIMEOUT = 10
#: Seconds the whole job may take before it is killed and the test fails.
LIMIT = 240
MARK = "SPAR_COMM_ELASTIC_TEST"


@pytest.fixture
def hosts():
    yield from two_emulated_hosts(EMU_PREFIX)


class Agent:
    """One host's torchrun, its output lines timed as they come."""

    def __init__(self, spec: emucluster.ClusterSpec, host: int, checkpoint: Path, marker: str):
        self.mark = f"{marker}-h{host}"
        command = ["ip", "netns", "exec", spec.namespace(host), sys.executable, "-m", "torch.distributed.run",
                   "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "2", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", f"{spec.addresses[0]}:{PORT}", "--rdzv-id", marker,
                   "--local-addr", spec.addresses[host],
                   # host 0 serves the rendezvous (torchrun knows no namespace's address as its own); a
                   # restarted round waits 2 s, not 30, for a host that is not coming back
                   "--rdzv-conf", f"is_host={int(host == 0)},last_call_timeout=2",
                   str(ROOT / "drivers" / "train_ddp.py"), "--epochs", "30", "--checkpoint", str(checkpoint),
                   "--checkpoint-every", "10"]
        env = dict(os.environ, **{MARK: self.mark, "GLOO_SOCKET_IFNAME": emucluster.IFACE, "OMP_NUM_THREADS": "1",
                                  "PYTHONFAULTHANDLER": "1", waiting.ENV_TIMEOUT: str(TIMEOUT)})
        env.pop("WORLD_SIZE", None)
        self.process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True)
        self.lines: List[tuple] = []  # (monotonic time, line) of stdout
        self.errors: List[tuple] = []  # of stderr
        self._readers = [threading.Thread(target=self._read, args=(self.process.stdout, self.lines), daemon=True),
                         threading.Thread(target=self._read, args=(self.process.stderr, self.errors), daemon=True)]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _read(stream, timed: List[tuple]) -> None:
        for line in stream:
            timed.append((time.monotonic(), line.rstrip("\n")))

    def processes(self) -> List[int]:
        """The live processes of this host's part of the job (the agent, its workers)."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as environ:
                    if f"{MARK}={self.mark}".encode() in environ.read().split(b"\0"):
                        found.append(int(pid))
            except OSError:
                continue
        return found

    def kill(self, sig: int = signal.SIGKILL) -> None:
        for pid in self.processes():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def first(self, pattern: str, stream: str = "lines") -> tuple:
        """(time, line) of the first line of stdout (``errors``: stderr) matching ``pattern``, or (None, None)."""
        return next(((t, line) for t, line in getattr(self, stream) if re.search(pattern, line)), (None, None))

    def output(self) -> str:
        return "\n".join(line for _, line in self.lines) + "\n" + "\n".join(line for _, line in self.errors)[-4000:]


def committed_step(checkpoint: Path) -> int:
    try:
        return int(re.search(r'"step": (\d+)', (checkpoint / "latest").read_text()).group(1))
    except (OSError, AttributeError):
        return 0


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_host_lost_mid_run_the_job_restarts_on_the_host_left_resumes_and_finishes(tmp_path, hosts, fault):
    """kill: host 1's processes die (gloo tells the survivor at once: "Connection reset by peer", or
    "Connection closed by peer", as the socket happens to learn it);
    stop: they stop answering (SIGSTOP: the survivor's wait meets SPAR_COMM_TIMEOUT's deadline)."""
    segments = mpi_segments()
    marker = f"elastic-{os.getpid()}-{time.monotonic_ns()}"
    checkpoint = tmp_path / "checkpoint"
    agents = [Agent(hosts, host, checkpoint, marker) for host in range(2)]
    try:
        deadline = time.monotonic() + LIMIT
        while committed_step(checkpoint) < 20:  # past the first save: training, not starting
            assert agents[0].process.poll() is None and time.monotonic() < deadline, agents[0].output()
            time.sleep(0.1)
        killed = agents[1].processes()
        assert len(killed) == 2, agents[1].output()  # the agent and its worker
        since, saved = time.monotonic(), committed_step(checkpoint)
        agents[1].kill(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        try:
            status = agents[0].process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {LIMIT} s:\n{agents[0].output()}")
        ended = time.monotonic()
        agents[1].kill()  # the stopped host's processes: a lost host's are gone
        for agent in agents:
            while agent.processes() and time.monotonic() < ended + 10:
                time.sleep(0.05)
        left = [pid for agent in agents for pid in agent.processes()]
    finally:
        for agent in agents:
            agent.kill()
    output = agents[0].output()
    assert status == 0, output
    assert left == [], f"processes left: {left}"
    # A process killed by SIGKILL cannot unlink its MPI singleton's file (named by its pid in hex): on a
    # real cluster it is on the lost host; here it is the harness's to remove. The survivor leaves none.
    # Named by pid, they are removed whether or not the dying process still maps them (an orphan a moment later).
    theirs = {f"mpich_shm_{pid:x}_0" for pid in killed}
    for name in (mpi_segments() - segments) & theirs:
        os.unlink(f"/dev/shm/{name}")
    assert orphaned_segments(segments) == set(), (f"host 1's processes {killed}; the survivor's workers: "
                                                  f"{[line for _, line in agents[0].errors if 'pid:' in line]}")
    restarted, resumed = agents[0].first(r"^resumed .* at step (\d+), saved by 2 ranks, on 1: ")
    assert resumed is not None, output
    step = int(re.search(r"at step (\d+)", resumed).group(1))
    assert step >= saved, (step, saved)  # the last committed save, or one committed as the fault came
    assert agents[0].first(r"^world size 1$")[1] is not None, output
    finished, done = agents[0].first(r"^done: .*parameters identical on all 1 ranks")
    assert done is not None, output
    reset, _ = agents[0].first(r"Connection (reset|closed) by peer" if fault == "kill" else
                               rf"no answer past the deadline \(SPAR_COMM_TIMEOUT={TIMEOUT}\)", "errors")
    assert reset is not None, output
    failed, _ = agents[0].first(r"failed \(exitcode", "errors")
    assert failed is not None, output  # the worker of the old world ended, and the agent saw it
    print(f"{fault} after step {saved}'s save: the survivor's worker noticed it after {reset - since:.1f} s and "
          f"ended {failed - since:.1f} s after it; restarted on 1 rank from step {step} {restarted - since:.1f} s "
          f"after the fault, finished {finished - since:.1f} s after it, the agent ended {ended - since:.1f} s "
          "after it")
    for _, line in agents[0].errors:
        if re.search(r"Error|error|deadline|Connection", line) and "hostname of the client" not in line:
            print("  survivor:", line[:300])
