"""Strings from the MPI library, made fit to store.

What ``MPI_Get_library_version`` and ``MPI_Get_processor_name`` return
differs by library: Open MPI's version string ends in a NUL character, which
an HDF5 string attribute refuses and a JSON file keeps as ``\\u0000``. Every
such string is cleaned here before a trace, a benchmark or a calibration
file stores it.
"""
from __future__ import annotations

import re

from mpi4py import MPI

#: C0 control characters and DEL, less tab and newline (a version string is several lines).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def clean(text: str) -> str:
    """``text`` without NULs and other control characters, trailing spaces of
    each line and blank lines at either end."""
    lines = _CONTROL.sub("", text).splitlines()
    return "\n".join(line.rstrip() for line in lines).strip("\n")


def library_version() -> str:
    """The MPI library's own description of itself, cleaned (several lines for MPICH)."""
    return clean(MPI.Get_library_version())


def library_name() -> str:
    """The first line of :func:`library_version`: which library and release."""
    return library_version().split("\n", 1)[0]


def processor_name() -> str:
    """This process's host as MPI names it, cleaned."""
    return clean(MPI.Get_processor_name())
