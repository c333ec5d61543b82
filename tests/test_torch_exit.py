"""A process whose communication thread is still in torch's C++ as its main
thread ends exits cleanly (comm_thread.py's docstring says why it did not:
"terminate called without an active exception", status -6)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("torch")

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
SPAR = {"setup": "from spar_comm.torch import comm_thread",
        "start": "comm_thread.submit(run, None)"}


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
              "comm_thread.submit(lambda job: (started.set(), threading.Event().wait()), None)\n"
              "started.wait()\nprint(time.monotonic(), flush=True)\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    ended = time.monotonic()  # the same clock as the child's, system-wide
    assert run.returncode == 0, run.stderr[-2000:]
    assert 2.0 <= ended - float(run.stdout) < 8


def test_the_optimizers_and_the_hooks_jobs_run_on_one_thread_in_the_order_handed_over():
    from spar_comm.torch import comm_thread

    ran, threads, done = [], set(), threading.Event()

    def optimizer_job(job):
        ran.append(("optimizer", job))
        threads.add(threading.current_thread().name)

    def hook_job(job):
        ran.append(("hook", job))
        threads.add(threading.current_thread().name)

    handed = [(optimizer_job if i % 3 else hook_job, i) for i in range(60)]
    for run, job in handed:
        comm_thread.submit(run, job)
    comm_thread.submit(lambda _: done.set(), None)
    assert done.wait(30)
    assert ran == [("optimizer" if i % 3 else "hook", i) for i in range(60)]
    assert threads == {"spar_comm-communication"}


def test_a_forked_child_makes_its_own_communication_thread():
    """A fork copies no thread: a job the child hands over must still run."""
    from spar_comm.torch import comm_thread

    comm_thread.submit(lambda _: None, None)  # the parent has its thread
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once its job ran, 1 if it never does
        done = threading.Event()
        comm_thread.submit(lambda _: done.set(), None)
        os._exit(0 if done.wait(20) else 1)
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        ended, status = os.waitpid(pid, os.WNOHANG)
        if ended:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail("the child's job never ran")
