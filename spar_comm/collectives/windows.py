"""Shared-memory windows over a node: every rank's segment of one mapping,
visible to all the node's ranks, behind one small interface (``segments``,
``fence()``, ``free()``) that ``shm.py``'s collectives use.

Two makers, chosen by the communicator (``open_window``):

* ``MPIWindow``: MPI's own (``MPI.Win.Allocate_shared``), on an MPI communicator;
* ``FileWindow``: a file in /dev/shm that local rank 0 makes and names to
  the others through the communicator, on any other (a torch.distributed
  group, ``torch/transport.py``, which has no windows). Rank 0 holds it
  mapped from its making, and unlinks its name as soon as every rank has
  mapped it (or given up), so nothing is left in /dev/shm however the job
  ends later, unless rank 0 is killed outright in between (then the
  launcher's cleanup, ``segments.py``, finds the file unheld); the memory
  goes with the last mapping. Its fence is the communicator's barrier,
  which no rank leaves before every rank has entered it: the backend's
  locks and messages order each rank's writes before its arrival.
"""
from __future__ import annotations

import atexit
import contextlib
import mmap
import os
import secrets
from typing import Any, Dict, List, Optional, Union

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..consensus import raise_if_any
from ..errors import SparCommError
from ..segments import SHM, WINDOW_PREFIX

#: A window's segments start on page boundaries.
PAGE = mmap.PAGESIZE


def open_window(comm: Any, elements: int, dtype: np.dtype) -> Union["MPIWindow", "FileWindow"]:
    """``elements`` of ``dtype`` a rank, shared over ``comm``'s ranks (one host's). Collective."""
    maker = MPIWindow if isinstance(comm, MPI.Comm) else FileWindow
    return maker(comm, elements, dtype)


# Windows still open when Python exits, freed before mpi4py's MPI_Finalize (an
# atexit handler registered after mpi4py's runs first): MPICH's OFI netmod
# cannot close its fabric while a window is open. Win.Free is collective: this
# assumes all ranks exit normally together (a rank failing alone aborts the job
# instead). Strong references: a window dropped unfreed would leak in MPI and
# break MPI_Finalize, so a window lives until free() or exit.
_OPEN: "Dict[int, MPIWindow]" = {}


@atexit.register
def _free_open_windows() -> None:
    if MPI.Is_initialized() and not MPI.Is_finalized():
        for window in list(_OPEN.values()):
            window.free()


class MPIWindow:
    """An MPI shared-memory window over a node: ``elements`` per rank, every
    rank's segment visible to all as ``segments[r]``."""

    def __init__(self, comm: MPI.Comm, elements: int, dtype: np.dtype):
        dtype = np.dtype(dtype)
        itemsize = dtype.itemsize
        self.comm = comm
        self.win = MPI.Win.Allocate_shared(elements * itemsize, itemsize, comm=comm)
        self.win.Lock_all(MPI.MODE_NOCHECK)
        _OPEN[id(self)] = self
        self.segments: List[np.ndarray] = [
            np.frombuffer(self.win.Shared_query(r)[0], dtype=dtype)[:elements] for r in range(comm.size)
        ]

    def fence(self) -> None:
        """Every rank's writes so far are visible to all, and every rank has arrived."""
        self.win.Sync()
        waiting.collective(self.comm, "Barrier")
        self.win.Sync()

    def free(self) -> None:
        if _OPEN.pop(id(self), None) is not None:
            self.win.Unlock_all()
            with waiting.watched("freeing a shared-memory window", self.comm):  # collective
                self.win.Free()


class WindowError(SparCommError):
    """A node's file window could not be made; raised on every rank of the node alike."""


class FileWindow:
    """A window made of one file in /dev/shm: ``elements`` per rank, rank r's
    segment at ``r`` times a whole number of pages, zeros to start with.
    WindowError on every rank of ``comm`` where it cannot be made (a /dev/shm
    too small; ranks that name one host but do not share its /dev/shm), and
    no file left."""

    def __init__(self, comm: Any, elements: int, dtype: np.dtype):
        dtype = np.dtype(dtype)
        self.comm = comm
        stride = max(PAGE, -(-elements * dtype.itemsize // PAGE) * PAGE)
        size = stride * comm.size
        name, mapped, problem = "", None, None
        if comm.rank == 0:  # mapped at once: the file is never unheld, which a cleanup would take for orphaned
            name = f"{WINDOW_PREFIX}{os.getpid()}_{secrets.token_hex(6)}"
            mapped, problem = _make(os.path.join(SHM, name), size)
        try:
            with waiting.watched("naming a shared-memory window", comm):
                name, made = comm.bcast((name, problem), root=0)
            if comm.rank != 0 and made is None:
                mapped, problem = _map(os.path.join(SHM, name), size)
            with waiting.watched("mapping a shared-memory window", comm):
                raise_if_any(comm, problem and f"the node's shared memory: {problem}", WindowError)
        except BaseException:
            if mapped is not None:
                mapped.close()
            raise
        finally:  # every rank has mapped it, or given up: the name is of no more use
            if comm.rank == 0 and problem is None:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(SHM, name))
        self.name: str = name  # gone from /dev/shm already
        self._mapped: Optional[mmap.mmap] = mapped
        self.segments: List[np.ndarray] = [np.frombuffer(mapped, dtype=dtype, count=elements, offset=r * stride)
                                           for r in range(comm.size)]

    def fence(self) -> None:
        """Every rank's writes so far are visible to all, and every rank has arrived."""
        waiting.collective(self.comm, "Barrier")

    def free(self) -> None:
        """Local: the memory is unmapped once no array of it is left."""
        self.segments, self._mapped = [], None


def _make(path: str, size: int) -> "tuple[Optional[mmap.mmap], Optional[str]]":
    """The file at ``path`` made with ``size`` bytes reserved, and mapped; or
    why not. Reserved, not only sized: a tmpfs page that cannot be had would
    otherwise end the process with SIGBUS at its first write."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        return None, f"cannot make {path}: {error.strerror}"
    try:
        os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size), None
    except OSError as error:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return None, f"cannot reserve {size} bytes in {SHM}: {error.strerror}"
    finally:
        os.close(fd)


def _map(path: str, size: int) -> "tuple[Optional[mmap.mmap], Optional[str]]":
    """The file at ``path`` mapped, or why not (a rank whose /dev/shm is not rank 0's finds no such file)."""
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as error:
        return None, f"cannot open {path}: {error.strerror}"
    try:
        return mmap.mmap(fd, size), None
    except (OSError, ValueError) as error:
        return None, f"cannot map {path}: {error}"
    finally:
        os.close(fd)
