"""spar_comm/segments.py: MPI's /dev/shm files that nothing maps are removed,
and never one that a live process still maps."""
from __future__ import annotations

import mmap
import os

import pytest

from shm_cleanup import mpi_segments, orphaned_segments, remove_orphaned_segments

pytestmark = pytest.mark.alone  # it counts the /dev/shm files nothing maps


def test_only_the_files_no_process_maps_are_orphaned():
    before = mpi_segments()
    names = [f"mpich_shm_test_segments_{os.getpid()}_{i}" for i in range(4)]
    maps = []
    try:
        for name in names:
            fd = os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_RDWR, 0o600)
            os.ftruncate(fd, mmap.PAGESIZE)
            maps.append(mmap.mmap(fd, mmap.PAGESIZE))
            os.close(fd)
        assert orphaned_segments(before) == set()  # every one is mapped, not only the first looked at
        maps.pop().close()
        assert orphaned_segments(before) == {names[-1]}
        remove_orphaned_segments(before)
        assert [name for name in names if os.path.exists(f"/dev/shm/{name}")] == names[:-1]
    finally:
        for m in maps:
            m.close()
        for name in names:
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
