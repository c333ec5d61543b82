"""A process whose communication thread is still in torch's C++ as its main
thread ends exits cleanly (comm_thread.py's docstring says why it did not:
"terminate called without an active exception", status -6)."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("torch")
pytestmark = pytest.mark.alone  # it times how long an exit waits

# A job that stays in C++ (matrix products, the GIL released) for about a
# second after the main thread has reached its end.
SCRIPT = """
import threading, time, torch
{setup}
a = torch.randn(1500, 1500)
started = threading.Event()

def run(job):
    started.set()
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        torch.mm(a, a)
    print("job done", flush=True)

{start}
started.wait()
print("main ends", flush=True)
"""

BARE = {"setup": "", "start": "threading.Thread(target=run, args=(None,), daemon=True).start()"}
SPAR = {"setup": "from spar_comm.torch.comm_thread import CommThread",
        "start": "CommThread('spar_comm-test', run).put(None)"}


def exit_of(parts: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", SCRIPT.format(**parts)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow  # 2 s: the quick tier keeps the CommThread's own exit below
def test_a_bare_daemon_thread_in_torch_at_exit_aborts_the_process():
    """The failure itself, so that the test below is known to test something."""
    run = exit_of(BARE)
    assert run.returncode == -6, (run.returncode, run.stderr[-1000:])
    assert "terminate called without an active exception" in run.stderr


def test_the_exit_waits_for_the_communication_threads_job():
    run = exit_of(SPAR)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["main", "ends", "job", "done"]


@pytest.mark.slow  # 7 s
def test_the_exit_leaves_a_thread_stuck_in_its_job_after_the_grace():
    """A job that never ends (a collective whose peers are gone) holds the exit for EXIT_GRACE_S, no longer."""
    script = ("import threading, time\nfrom spar_comm.torch import comm_thread\ncomm_thread.EXIT_GRACE_S = 2.0\n"
              "started = threading.Event()\n"
              "comm_thread.CommThread('stuck', lambda job: (started.set(), threading.Event().wait())).put(None)\n"
              "started.wait()\nprint(time.monotonic(), flush=True)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    ended = time.monotonic()  # the same clock as the child's, system-wide
    assert run.returncode == 0, run.stderr[-2000:]
    assert 2.0 <= ended - float(run.stdout) < 8
