"""The shared-memory files that aborted jobs leave in /dev/shm (MPICH's,
Open MPI's, and spar_comm's own windows under torch.distributed, whose
rank 0 is killed while making one), and their removal: by a rank that ends the job
(``remove_mapped``), and by what launched a job once it has ended
(``remove_orphaned``: ``emucluster.py run``, the test harness).

No MPI and no other module of spar_comm here: launchers that must not
initialise MPI load this file by its path (``tests/shm_cleanup.py``)."""
from __future__ import annotations

import contextlib
import os


SHM = "/dev/shm"
#: spar_comm's own windows' files (``collectives/windows.py``), unlinked once mapped.
WINDOW_PREFIX = "spar_comm_window_"
#: MPICH's files, Open MPI's (its shared-memory transport and windows), and spar_comm's.
PREFIXES = ("mpich_shm_", "sm_segment.", WINDOW_PREFIX)


def mpi_segments() -> set:
    """The names of the shared-memory files of ``PREFIXES`` now in /dev/shm."""
    try:
        return {name for name in os.listdir(SHM) if name.startswith(PREFIXES)}
    except OSError:
        return set()


def orphaned_segments(before: set) -> set:
    """Shared-memory files (``mpi_segments``) that appeared since ``before``
    and that no live process maps or holds open: what a job ended by
    MPI_Abort or SIGKILL leaves behind (it gets no chance to unlink them)."""
    new = mpi_segments() - before
    if not new:
        return new
    in_use = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as maps:
                mapped = maps.read()
            in_use.update(name for name in new if name in mapped)
            in_use.update(name for fd in os.listdir(f"/proc/{pid}/fd")
                          for name in new if name in os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return new - in_use


def remove_orphaned_segments(before: set) -> None:
    """Remove ``orphaned_segments(before)``."""
    for name in orphaned_segments(before):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM, name))


def remove_mapped_segments() -> None:
    """Unlink MPI's shared-memory files that this process maps: a job ended by
    an abort leaves them, since MPI gets no chance to. The ranks still mapping
    them keep their memory until they exit."""
    try:
        with open("/proc/self/maps") as maps:
            names = {os.path.basename(line.split()[-1]) for line in maps if f" {SHM}/" in line}
    except OSError:
        return
    for name in names:
        if name.startswith(PREFIXES):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(SHM, name))
