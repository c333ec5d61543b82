"""spar_comm/segments.py, loaded by its path: the launcher of the MPI suites
imports this, and must not initialise MPI."""
from __future__ import annotations

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "spar_comm_segments", Path(__file__).resolve().parent.parent / "spar_comm" / "segments.py")
_segments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_segments)

mpi_segments = _segments.mpi_segments
orphaned_segments = _segments.orphaned_segments
remove_orphaned_segments = _segments.remove_orphaned_segments
remove_mapped_segments = _segments.remove_mapped_segments
