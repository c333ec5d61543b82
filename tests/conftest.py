"""Shared test helpers. MPI tests run under ``tests/run_mpi.py``, which starts
``pytest --with-mpi`` under mpiexec at several world sizes with a hard limit."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))  # for `import reference`
# Device kernels run under Numba's CUDA simulator unless told otherwise (a GPU
# machine sets NUMBA_ENABLE_CUDASIM=0); it must be set before numba is imported.
os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")


import contextlib
import functools
import shutil
import signal
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Iterator, Optional, Tuple

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import LAYOUT_WORLDS, RANK_WORLDS, layout_name, layouts
from run_mpi import LAUNCHES, kill_marked, launches
from run_scale import LAYOUTS as SCALE_LAUNCHES
from shm_cleanup import mpi_segments, remove_mapped_segments, remove_orphaned_segments
from spar_comm import Topology, emucluster

ROOT = Path(__file__).resolve().parent.parent
#: MPI's shared-memory files in /dev/shm when the run started.
SEGMENTS_AT_START = pytest.StashKey[set]()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: left out of `make test-quick` (a driver run or a simulated kernel sweep)")
    config.addinivalue_line("markers", "worlds(*sizes): the MPI world sizes the test runs at (default: "
                            f"{LAYOUT_WORLDS} on the topology fixture's layouts, else {RANK_WORLDS})")
    config.addinivalue_line("markers", "openmpi: run under Open MPI too (make test-openmpi)")
    config.addinivalue_line("markers", "alone: run with no other test beside it (make test-serial runs the rest "
                            "two at a time): it times a deadline, counts /dev/shm files or shapes an emulated network")
    config.stash[SEGMENTS_AT_START] = mpi_segments()


#: The world sizes tests/run_mpi.py (make test) and tests/run_scale.py (make
#: test-scale) launch: a test asking for any other would never run.
LAUNCHED_WORLDS = {ranks for ranks, _ in launches(LAUNCHES) + SCALE_LAUNCHES}


def pytest_addoption(parser):
    parser.addoption("--any-world", action="store_true",
                     help="run every MPI test at this launch's world size, whatever sizes it asks for "
                          "(make test-gpu: on a real GPU every size counts)")


def worlds(item: pytest.Item) -> tuple:
    """The world sizes an MPI test runs at: its ``worlds`` marker's, else the
    default for what it is (a test over the topology fixture's layouts, or not)."""
    marker = item.get_closest_marker("worlds")
    if marker is not None:
        return marker.args
    on_layouts = "topology" in getattr(getattr(item, "callspec", None), "params", {})
    return LAYOUT_WORLDS if on_layouts else RANK_WORLDS


def pytest_collection_modifyitems(config, items):
    """Each MPI launch keeps the MPI tests that asked for its world size
    (``worlds``); the rest are deselected, not skipped. A test asking for a
    size no launch has is an error here, in the serial run too."""
    unreachable = [item.nodeid for item in items if item.get_closest_marker("mpi") is not None
                   and not set(worlds(item)) & LAUNCHED_WORLDS]
    if unreachable:
        raise pytest.UsageError(f"asks for no world size that tests/run_mpi.py or tests/run_scale.py launches "
                                f"{sorted(LAUNCHED_WORLDS)}: " + ", ".join(unreachable[:5]))
    if config.getoption("--any-world") or not (config.getoption("--with-mpi") or config.getoption("--only-mpi")):
        return
    size = MPI.COMM_WORLD.size
    kept, left = [], []
    for item in items:
        (kept if item.get_closest_marker("mpi") is None or size in worlds(item) else left).append(item)
    if left:
        config.hook.pytest_deselected(items=left)
        items[:] = kept


def pytest_sessionfinish(session, exitstatus):
    """Once more at the end of a serial run: MPI's files that a job's last
    processes released only after their test had ended, and this process's
    own, which Open MPI makes for a singleton and leaves at its exit (no
    other process ever maps them; the mapping outlives the name)."""
    if MPI.COMM_WORLD.size == 1:
        remove_orphaned_segments(session.config.stash[SEGMENTS_AT_START])
        remove_mapped_segments()


@contextlib.contextmanager
def emulated_cluster(hosts: int, ranks_per_host: int, prefix: str) -> Iterator[emucluster.ClusterSpec]:
    """An emulated cluster of 1 Gbit/s links for the block, torn down after it
    (and before, should an earlier run have left one). ``prefix``: the test's
    own, so that a user's cluster is never touched."""
    emucluster.down(prefix)
    try:
        yield emucluster.up(emucluster.ClusterSpec(hosts, ranks_per_host, "1gbit", "0us", prefix))
    finally:
        emucluster.down(prefix)


@functools.lru_cache(maxsize=None)
def emulated_cluster_unavailable() -> Optional[str]:
    """Why no emulated cluster can run here (no root or namespaces, or no MPICH), else None."""
    try:
        emucluster.require_hydra(emucluster.default_mpiexec())
    except emucluster.EmuClusterError as error:
        return str(error)
    return emucluster.available()


def two_emulated_hosts(prefix: str) -> Iterator[emucluster.ClusterSpec]:
    """A fixture's body: 2 emulated hosts of 1 rank (``emulated_cluster``), or the test skipped where none can run."""
    reason = emulated_cluster_unavailable()
    if reason is not None:
        pytest.skip(f"no emulated cluster here: {reason}")
    with emulated_cluster(2, 1, prefix) as spec:
        yield spec


def torchrun(ranks: int, script: Path, *args: str, env: Optional[dict] = None,
             limit: float = 90) -> Tuple[subprocess.CompletedProcess, int]:
    """``script`` under ``torchrun --standalone --nproc-per-node ranks`` (one
    thread a rank, no WORLD_SIZE inherited, ``env`` added), failed past
    ``limit`` seconds: the finished run, and how many of its processes were
    left once it ended (killed then)."""
    marker = f"torchrun-{os.getpid()}-{time.monotonic_ns()}"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--standalone",
               str(script), *args]
    # PYTHONFAULTHANDLER: a worker that dies by a signal prints every thread's stack.
    environment = dict(os.environ, SPAR_COMM_TEST_LAUNCH=marker, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1",
                       **(env or {}))
    environment.pop("WORLD_SIZE", None)
    process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        output, errors = process.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        kill_marked(marker)
        output, errors = process.communicate()
        pytest.fail(f"torchrun did not end within {limit} s:\n{output[-2000:]}\n{errors[-2000:]}")
    left = kill_marked(marker)
    return subprocess.CompletedProcess(command, process.returncode, output, errors), left


def find_mpiexec() -> str:
    """The launcher the tests start drivers with: ``$SPAR_COMM_MPIEXEC`` when set
    (an MPI on PATH, say), else the one next to this Python (the wheel's), else
    the one on PATH. It must belong to the MPI that this Python's mpi4py loads."""
    return (os.environ.get("SPAR_COMM_MPIEXEC") or shutil.which("mpiexec", path=os.path.dirname(sys.executable))
            or shutil.which("mpiexec") or "mpiexec")


def _locked_shared_arrays(monkeypatch) -> None:
    """Numba's simulator makes a block's shared array when the first thread
    asks for it, with no lock: two threads can each make one and work on
    different arrays (seen: a wrong selection about once in 50 calls with a
    short switch interval). The same allocation, under a lock."""
    from numba import types
    from numba.cuda.simulator import kernelapi
    from numba.np import numpy_support

    plain, lock = kernelapi.FakeCUDAShared.array, threading.Lock()

    def array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:  # dynamic shared memory, or a refusal: as the simulator does
            return plain(self, shape, dtype, alignment)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[-1][0:2]  # the simulator's key: file and line
        with lock:
            if caller not in self._allocations:
                as_numpy = numpy_support.as_dtype(dtype) if isinstance(dtype, types.Type) else dtype
                self._allocations[caller] = np.empty(shape, as_numpy)
            return self._allocations[caller]

    monkeypatch.setattr(kernelapi.FakeCUDAShared, "array", array)


@pytest.fixture
def fast_simulator(monkeypatch):
    """Numba's CUDA simulator runs a Python thread per GPU thread, and each of
    its barriers waits for the interpreter to switch threads (every 5 ms by
    default): a shorter switch interval runs simulated kernels several times
    faster (measured: a selection of 1,553 entries in 0.26 s instead of 2.1).
    Threads then interleave more, so the simulator's shared arrays are made
    under a lock (``_locked_shared_arrays``)."""
    _locked_shared_arrays(monkeypatch)
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(before)


@pytest.fixture(autouse=True)
def no_orphaned_shared_memory():
    """Tests that end a job on purpose (MPI_Abort, SIGKILL) leave MPI's
    /dev/shm files behind; remove those nothing uses any more."""
    before = mpi_segments()
    yield
    if MPI.COMM_WORLD.size == 1:  # a serial test: the jobs it started have ended
        remove_orphaned_segments(before)


@pytest.fixture
def run_driver():
    """Run ``drivers/NAME`` (under ``mpiexec -n ranks`` when ranks is given) with a
    hard time limit; returns the CompletedProcess with text output."""

    def run(name, *args, ranks=None, timeout=120, env=None):
        command = [sys.executable, str(ROOT / "drivers" / name), *map(str, args)]
        if ranks:
            command = [find_mpiexec(), "-n", str(ranks), *command]
        return subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
            env={**os.environ, **(env or {})},
        )

    return run


@pytest.fixture(scope="module", params=list(layouts(MPI.COMM_WORLD.size)),
                ids=lambda r: layout_name(MPI.COMM_WORLD.size, r))
def topology(request):
    """A topology of emulated nodes, once for every node size worth testing at
    this world size (MPI tests; a module may define its own). Its ids name the
    layout: ``2x2``, ``2+1``."""
    topo = Topology(ranks_per_node=request.param)
    yield topo
    topo.free()
