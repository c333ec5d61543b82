"""collectives/windows.py's file windows (a torch.distributed group's node
memory), over MPI's node communicators: every rank sees every segment, the
file is gone from /dev/shm once made, and a window that cannot be made is
refused on every rank with nothing left behind, and the node then takes the
message collectives."""
from __future__ import annotations

import errno
import os
import warnings

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all
from spar_comm.collectives import shm, windows
from spar_comm.collectives.channel import Channel
from spar_comm.collectives.windows import WindowError
from spar_comm.segments import SHM, WINDOW_PREFIX

COMM = MPI.COMM_WORLD
pytestmark = pytest.mark.openmpi  # make test-openmpi: each library's shared-memory windows and files


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("elements, dtype", [(1, "float32"), (1037, "float64"), (5000, "int16")])
def test_every_rank_sees_every_segment_and_the_name_is_gone(topology, elements, dtype):
    node = topology.local
    window = windows.FileWindow(node, elements, dtype)
    starts_zero = all(not segment.any() for segment in window.segments)
    window.fence()  # every rank has looked before any writes
    window.segments[node.rank][...] = np.arange(elements) % 97 + node.rank
    window.fence()
    seen = [np.array_equal(segment, np.arange(elements) % 97 + r) for r, segment in enumerate(window.segments)]
    kept = window.segments[(node.rank + 1) % node.size]
    window.fence()  # nobody frees before every rank has read
    window.free()
    assert_all(COMM, starts_zero, "a new window does not hold zeros")
    assert_all(COMM, all(seen) and len(seen) == node.size, f"segments as written: {seen}")
    assert_all(COMM, not os.path.exists(os.path.join(SHM, window.name)), f"{window.name} left in {SHM}")
    assert_all(COMM, window.segments == [] and np.array_equal(kept, np.arange(elements) % 97 + (node.rank + 1) % node.size),
               "an array of a freed window no longer reads what it held")


def made_by(node) -> set:
    """The window files in /dev/shm that ``node``'s rank 0 made (their names carry its pid)."""
    prefix = f"{WINDOW_PREFIX}{node.bcast(os.getpid(), root=0)}_"
    return {name for name in os.listdir(SHM) if name.startswith(prefix)}


def fail_on(node, failing: str, monkeypatch) -> None:
    """Local rank 0 cannot reserve the memory (a full /dev/shm), or the node's
    last rank cannot open the file (its /dev/shm is not rank 0's)."""
    if failing == "make" and node.rank == 0:
        def full(fd, offset, size):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        monkeypatch.setattr(windows.os, "posix_fallocate", full)
    if failing == "map" and node.rank == node.size - 1:
        monkeypatch.setattr(windows, "_map", lambda path, size: (None, f"cannot open {path}: No such file"))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("failing", ["make", "map"])
def test_a_window_that_cannot_be_made_is_refused_on_every_rank_and_leaves_nothing(topology, monkeypatch, failing):
    """WindowError on every rank of the node, naming the cause, and no file left."""
    node = topology.local
    if failing == "map" and not COMM.allreduce(node.size > 1, op=MPI.LAND):  # on all alike
        pytest.skip("rank 0 maps the file it makes: a node of one has no other rank to fail")
    fail_on(node, failing, monkeypatch)
    try:
        windows.FileWindow(node, 4096, "float32")
        message = "no WindowError"
    except WindowError as error:
        message = str(error)
    named = os.strerror(errno.ENOSPC) in message if failing == "make" else "No such file" in message
    assert_all(COMM, named, message)
    left = made_by(node)
    assert_all(COMM, left == set(), f"left in {SHM}: {left}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("failing", ["make", "map"])
def test_the_node_takes_messages_where_its_windows_cannot_be_made(topology, monkeypatch, failing):
    """``shm.node_collectives`` over file windows that cannot be made: the
    node's ranks take the message collectives alike, with a warning."""
    if not COMM.allreduce(topology.local_size > 1 and topology.local_shares_memory, op=MPI.LAND):
        pytest.skip("needs two ranks sharing memory on every node")
    node = topology.local
    monkeypatch.setattr(shm, "open_window", windows.FileWindow)
    fail_on(node, failing, monkeypatch)
    channel = Channel(node, "intra", {"t_intra": 0.0, "bytes_intra": 0, "bytes_staged": 0})
    counts = topology.local_shard_counts(1037)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        scatter, gather = shm.node_collectives(channel, counts, np.dtype("float32"), True)
    taken = (type(scatter).__name__, type(gather).__name__)
    assert_all(COMM, taken == ("MessageReduceScatter", "MessageAllgather"), f"took {taken}")
    said = [str(w.message) for w in warned]
    assert_all(COMM, any("go by messages" in text for text in said), f"warned {said}")
    left = made_by(node)
    assert_all(COMM, left == set(), f"left in {SHM}: {left}")
