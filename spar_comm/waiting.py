"""Waiting for other ranks without taking their cores.

MPICH and Open MPI wait by polling: a rank blocked in a collective spins at
full speed until the last rank arrives. Where cores are shared (more ranks
than cores, or the communication thread that ``DistributedOptimizer`` runs
beside backward) the spinning rank takes CPU from the ranks it waits for.

So the calls that mostly wait (the check at the start of every allreduce,
the node's fences, and small messages, which MPI moves in a few steps)
start the nonblocking form of the collective and test it, sleeping between
tests, the pause doubling from ``FIRST_PAUSE``. MPI advances a collective's
schedule only inside a rank's MPI calls, and the short-message algorithms
take about log2(p) rounds over p ranks: the rank that arrives last finds
the others asleep, and each round may wait for a sleeper's pause. So a
pause is at most ``MAX_PAUSE`` divided by ceil(log2 p), and the pauses of
those rounds add about ``MAX_PAUSE``, plus what the system oversleeps each
time (collectives near ``SMALL_BYTES`` may take more rounds). Large
messages keep the blocking call, since MPI moves their bytes only while it
is polled. On 4 ranks over 2 cores this takes a tenth or more off a
17M-parameter MLP's ``hitopk`` step (docs/results/peers.md).

``SPAR_COMM_WAIT=spin`` waits in MPI instead (``MPI_Wait``), for dedicated
cores where the wake-up latency is what counts. Either way the MPI calls are
the same, so ranks may differ in it: MPI never matches a blocking collective
with a nonblocking one, so the choice between them depends only on message
sizes that every rank shares.

Every wait has a deadline, ``SPAR_COMM_TIMEOUT`` seconds (``TIMEOUT``): a
stalled rank, a dead link or a hung peer ends the job instead of hanging it.
A wait registers itself (``watched``: what, over which communicator, since
when) and a watchdog thread, started with the first wait, looks at the
registered waits every ``TICK`` seconds. So the calls themselves stay as they
are (a blocking call for large messages, which MPI moves only while polled):
the cost of a deadline is a dictionary entry per call, not a polling loop.
Half-way the rank warns once; past the deadline it prints one line naming the
wait, runs what ``at_end`` registered (the trace is closed), removes the MPI
shared-memory files it maps and ends the job with ``EXIT_TIMEOUT`` through
``MPI_Abort``, or by itself ``ABORT_GRACE_S`` later where no abort gets
through (a rank cut off from the others). Waits that are long for a reason (a
checkpoint written by rank 0, an allreducer's first call, which compiles, the
timing of the link) are ``patient``: their deadline is ``PATIENCE_S`` longer.

The watchdog also hears signals, through ``signal.set_wakeup_fd``, even
while the rank is inside a blocking MPI call where no Python handler runs: a
rank still in a wait ``SIGNAL_GRACE_S`` after a signal that has a Python
handler (SIGINT, and SIGTERM and SIGUSR1 under ``train()``'s clean stop) is
stuck, since a healthy job finishes its step by then, and ends the job with
status 128 + the signal's number. A patient wait ends on the second signal.
"""
from __future__ import annotations

import contextlib
import math
import os
import select
import signal
import sys
import threading
import time
from time import monotonic  # the watchdog's clock, apart from the pauses of ``wait``
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional

from .segments import remove_mapped_segments

if TYPE_CHECKING:  # loaded where a job is ended or its rank named, so that importing this initialises no MPI
    from mpi4py import MPI


#: ``sleep`` (the default) or ``spin``; read when a ``Topology`` is made.
ENV_WAIT = "SPAR_COMM_WAIT"
#: Seconds of the first pause, and of the pauses a collective's rounds share.
FIRST_PAUSE = 1e-5
MAX_PAUSE = 2e-4
#: Collectives of at most this many bytes a rank go nonblocking (a rail's
#: exchange of top-k pairs, 69 KB for a 17M model at density 0.001, is one).
SMALL_BYTES = 1 << 18
#: Whether waits sleep between tests (``read_environment`` sets it).
SLEEP = True

#: Seconds a wait may last; 0 in the environment (None here): no deadline.
ENV_TIMEOUT = "SPAR_COMM_TIMEOUT"
DEFAULT_TIMEOUT = 600.0
TIMEOUT: Optional[float] = DEFAULT_TIMEOUT
#: The exit status of a job a deadline ended (sysexits' EX_TEMPFAIL: resume it).
EXIT_TIMEOUT = 75
#: Seconds a patient wait has beyond ``TIMEOUT``.
PATIENCE_S = 600.0
#: Seconds a wait may go on after a signal before the rank counts as stuck.
SIGNAL_GRACE_S = 2.0
#: Seconds between the watchdog's looks at the waits.
TICK = 0.25
#: Seconds MPI_Abort has to end the job before the rank exits by itself.
ABORT_GRACE_S = 3.0
# MPICH's launcher may act on an abort before it has forwarded the aborting
# rank's last lines of stderr, and drop them: 7 of 30 jobs lost the traceback.
# A pause between the flush and the abort lets the output leave first.
OUTPUT_GRACE_S = 0.2


def read_environment() -> Optional[str]:
    """Set ``SLEEP`` from ``SPAR_COMM_WAIT`` and ``TIMEOUT`` from
    ``SPAR_COMM_TIMEOUT``; a problem with their values, or None (nothing set then)."""
    global SLEEP, TIMEOUT
    text = os.environ.get(ENV_WAIT, "sleep").strip()
    if text not in ("sleep", "spin"):
        return f"{ENV_WAIT}={text!r}: expected 'sleep' or 'spin'"
    limit = os.environ.get(ENV_TIMEOUT, "").strip()
    seconds = DEFAULT_TIMEOUT
    if limit:
        try:
            seconds = float(limit)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and seconds >= 0):
            return f"{ENV_TIMEOUT}={limit!r}: expected seconds, a number > 0 (0: no deadline)"
    SLEEP = text == "sleep"
    TIMEOUT = seconds or None
    return None


# -- deadlines ---------------------------------------------------------------------------
#: The wait each thread is in, by thread id (the outermost, where they nest).
_WAITS: Dict[int, "watched"] = {}
#: What runs before a deadline or a signal ends the job (``at_end``).
_AT_END: List[Callable[[], None]] = []
_WATCHDOG: Optional[threading.Thread] = None
_START_LOCK = threading.Lock()
_ENDING = threading.Lock()


def describe(comm: Any) -> str:
    """Which communicator: the name ``Topology`` gave it (inside a node,
    between nodes, world) and its size."""
    name = ""
    try:
        name = comm.Get_name()
    except Exception:  # noqa: BLE001  (a torch group, or a stand-in: nothing to name)
        pass
    size = getattr(comm, "size", "?")
    return f"{name} ({size} ranks)" if name and not name.startswith("MPI_COMM") else f"a communicator of {size} ranks"


class watched:
    """A deadline on the block: what it waits for, over ``comm``, for at most
    ``TIMEOUT`` seconds (``PATIENCE_S`` more when ``patient``). Where blocks
    nest in one thread the outermost holds: its deadline covers the inner ones."""

    __slots__ = ("what", "comm", "patient", "since", "limit", "warned", "signals")

    def __init__(self, what: str, comm: Any = None, patient: bool = False):
        self.what, self.comm, self.patient = what, comm, patient

    def __enter__(self) -> "watched":
        if TIMEOUT is not None:
            ident = threading.get_ident()
            if ident not in _WAITS:
                self.since, self.warned, self.signals = monotonic(), False, 0
                self.limit = TIMEOUT + (PATIENCE_S if self.patient else 0.0)
                _WAITS[ident] = self
                if _WATCHDOG is None:
                    _start_watchdog()
        return self

    def __exit__(self, *exc: Any) -> None:
        ident = threading.get_ident()
        if _WAITS.get(ident) is self:
            del _WAITS[ident]

    def line(self, waited: float) -> str:
        """What is waited for, where, and how long: for the messages."""
        over = f" over {describe(self.comm)}" if self.comm is not None else ""
        return f"{self.what}{over}, waiting {waited:.1f} s"


def at_end(callback: Callable[[], None]) -> Callable[[], None]:
    """Run ``callback`` (close a file) before a deadline or a signal ends the
    job; returns what removes it again."""
    _AT_END.append(callback)
    return lambda: _AT_END.remove(callback) if callback in _AT_END else None


def job_rank() -> int:
    """This process's rank in its job, for the messages: MPI's, or where each
    process is an MPI world of one under a launcher that numbers them itself
    (torchrun's ``RANK``), the launcher's."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    launched = os.environ.get("RANK", "")
    return int(launched) if world.size == 1 and launched.isdigit() else world.rank


def end_job(message: str, status: int, comm: Optional[MPI.Comm] = None) -> None:
    """Say why on stderr (each line prefixed with the rank), run ``at_end``'s
    callbacks, remove the MPI shared-memory files this rank maps and end the
    whole job with ``status``: MPI_Abort on COMM_WORLD (``comm``: a
    torch.distributed transport's own abort instead), or this process alone
    ``ABORT_GRACE_S`` later where the abort cannot reach the launcher. MPICH
    aborts COMM_WORLD through its launcher, which kills every process, and any
    other communicator (a duplicate of the world too) by a message to its
    ranks, which a rank stopped, or stuck outside MPI, never reads: aborting
    the world's duplicate left a stopped rank running in 4 of 69 jobs of
    test_faults' signal test. Never returns; a second thread to call it
    waits for the end."""
    from mpi4py import MPI

    if not _ENDING.acquire(blocking=False):
        threading.Event().wait()
    if comm is None or isinstance(comm, MPI.Comm):
        comm = MPI.COMM_WORLD
    prefix = f"[rank {job_rank()}] "
    sys.stderr.write("".join(prefix + line + "\n" for line in message.splitlines()))
    sys.stderr.flush()
    for callback in list(_AT_END):
        try:
            callback()
        except Exception as error:  # noqa: BLE001  (the job ends anyway: say what was not saved)
            sys.stderr.write(f"{prefix}while ending: {type(error).__name__}: {error}\n")
    remove_mapped_segments()
    sys.stderr.flush()
    exit_anyway = threading.Timer(ABORT_GRACE_S, os._exit, (status,))
    exit_anyway.daemon = True
    exit_anyway.start()
    time.sleep(OUTPUT_GRACE_S)
    comm.Abort(status)


def _start_watchdog() -> None:
    """The watchdog thread, and from the main thread the pipe that signals wake it through."""
    global _WATCHDOG
    with _START_LOCK:
        if _WATCHDOG is not None:
            return
        wakeup, write = os.pipe()  # a signal's number arrives here, from the main thread's handler
        os.set_blocking(write, False)
        if threading.current_thread() is threading.main_thread():
            held = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
            if held != -1:  # someone else's (an event loop): theirs stays, and signals are theirs
                signal.set_wakeup_fd(held)
        _WATCHDOG = threading.Thread(target=_watch, args=(wakeup,), name="spar_comm deadlines", daemon=True)
        _WATCHDOG.start()


def _watch(wakeup: int) -> None:
    """The watchdog's loop: warn half-way, end the job past a deadline or when
    a signal finds a rank stuck."""
    signalled: Optional[tuple] = None  # (signal number, when)
    while True:
        ready, _, _ = select.select([wakeup], [], [], TICK)
        for number in os.read(wakeup, 512) if ready else b"":
            signalled = (number, monotonic())
            for wait in list(_WAITS.values()):
                wait.signals += 1
        now = monotonic()
        for wait in list(_WAITS.values()):
            waited = now - wait.since
            if waited >= wait.limit:
                end_job(f"spar_comm: no answer past the deadline ({ENV_TIMEOUT}={TIMEOUT:g}"
                        f"{f' + {PATIENCE_S:g} s of patience' if wait.patient else ''}): "
                        f"{wait.line(waited)}; ending the job with status {EXIT_TIMEOUT}", EXIT_TIMEOUT)
            elif waited >= wait.limit / 2 and not wait.warned:
                wait.warned = True
                sys.stderr.write(f"[rank {job_rank()}] spar_comm: still waiting, half-way to the deadline: "
                                 f"{wait.line(waited)}\n")
                sys.stderr.flush()
            elif signalled is not None and wait.signals > wait.patient:
                number, when = signalled
                if now - max(when, wait.since) >= SIGNAL_GRACE_S:
                    name = signal.Signals(number).name
                    end_job(f"spar_comm: {name} while stuck: {wait.line(waited)}; ending the job with status "
                            f"{128 + number}", 128 + number)


@contextlib.contextmanager
def deadlines(on: bool) -> Iterator[None]:
    """Waits keep their deadlines (``on``, where the job has them) or go
    without inside the block: a benchmark's way of pricing the deadlines in
    one job. The watchdog, once started, stays; it wakes every ``TICK``."""
    global TIMEOUT
    held = TIMEOUT
    TIMEOUT = held if on else None
    try:
        yield
    finally:
        TIMEOUT = held


@contextlib.contextmanager
def sleeping(on: bool) -> Iterator[None]:
    """Waits sleep (``on``) or spin inside the block, as before it after:
    a benchmark's way of comparing both in one job."""
    global SLEEP
    held, SLEEP = SLEEP, on
    try:
        yield
    finally:
        SLEEP = held


def longest_pause(ranks: int) -> float:
    """The cap on one pause in a collective over ``ranks``: ``MAX_PAUSE``
    shared by its ceil(log2(ranks)) rounds, and never below ``FIRST_PAUSE``."""
    rounds = max(1, (ranks - 1).bit_length())
    return max(FIRST_PAUSE, MAX_PAUSE / rounds)


def wait(request: MPI.Request, ranks: int) -> None:
    """Complete ``request`` of a collective over ``ranks``: sleeping between
    tests, or in ``MPI_Wait``."""
    if not SLEEP:
        request.Wait()
        return
    pause, longest = FIRST_PAUSE, longest_pause(ranks)
    while not request.Test():
        time.sleep(pause)
        pause = min(2 * pause, longest)


def collective(comm: MPI.Comm, name: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> None:
    """``comm.<name>(*args, **kwargs)`` (``Barrier``, ``Allgather``, ...) under
    a deadline: its nonblocking form and ``wait`` when ``nbytes`` (this call's
    bytes a rank, equal on every rank) is at most ``SMALL_BYTES``, else the
    blocking call."""
    with watched(name, comm):
        if nbytes <= SMALL_BYTES:
            wait(getattr(comm, "I" + name.lower())(*args, **kwargs), comm.size)
        else:
            getattr(comm, name)(*args, **kwargs)
