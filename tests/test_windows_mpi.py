"""collectives/windows.py's file windows (a torch.distributed group's node
memory), over MPI's node communicators: every rank sees every segment, the
file is gone from /dev/shm once made, and a window that cannot be made is
refused on every rank with nothing left behind."""
from __future__ import annotations

import os

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all
from spar_comm.collectives import windows
from spar_comm.errors import ConfigError
from spar_comm.segments import SHM, WINDOW_PREFIX

COMM = MPI.COMM_WORLD


def ours() -> set:
    return {name for name in os.listdir(SHM) if name.startswith(WINDOW_PREFIX)}


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


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("failing", ["make", "map"])
def test_a_window_that_cannot_be_made_is_refused_on_every_rank_and_leaves_nothing(topology, monkeypatch, failing):
    """Local rank 0 cannot reserve the memory (a full /dev/shm), or the node's
    last rank cannot map the file (on another host): ConfigError on every
    rank of the node, naming it, and no file left."""
    node = topology.local
    before = ours()
    if failing == "make" and node.rank == 0:
        monkeypatch.setattr(windows, "_make", lambda path, size: f"cannot reserve {size} bytes in {SHM}: No space left")
    if failing == "map" and node.rank == node.size - 1:
        monkeypatch.setattr(windows, "_map", lambda path, size: (None, f"cannot open {path}: No such file"))
    with pytest.raises(ConfigError) as raised:
        windows.FileWindow(node, 4096, "float32")
    message = str(raised.value)
    named = "No space left" in message if failing == "make" else "No such file" in message
    assert_all(COMM, named and "SPAR_COMM_SHM=0" in message, message)
    node.Barrier()  # every rank is past the refusal before the files are counted
    assert_all(COMM, ours() - before == set(), f"left in {SHM}: {ours() - before}")
