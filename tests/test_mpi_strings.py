"""Strings from the MPI library are cleaned before they are stored: Open MPI's
version string ends in a NUL, which an HDF5 string attribute refuses."""
from __future__ import annotations

import string
from types import SimpleNamespace

import h5py
import pytest
from mpi4py import MPI

from spar_comm import mpi_strings
from spar_comm.files import text_attributes
from spar_comm.training.trace import TraceWriter

OPEN_MPI_VERSION = "Open MPI v5.0.11, package: Open MPI user@localhost Distribution, ident: 5.0.11\x00"
ALLOWED = set(string.printable) - set("\r\x0b\x0c")
pytestmark = pytest.mark.openmpi  # make test-openmpi: the strings each library hands back (Open MPI's end in a NUL)


@pytest.mark.parametrize("raw, cleaned", [
    (OPEN_MPI_VERSION, OPEN_MPI_VERSION[:-1]),
    ("MPICH Version:  5.0.2\nMPICH FC:   \n\n", "MPICH Version:  5.0.2\nMPICH FC:"),
    ("node\x00\x01-7\x7f", "node-7"),
    ("a\tb\r\nc", "a\tb\nc"),
    ("\x00", ""),
])
def test_control_characters_and_trailing_spaces_go(raw, cleaned):
    assert mpi_strings.clean(raw) == cleaned


def test_the_loaded_librarys_strings_are_printable():
    version, name, host = mpi_strings.library_version(), mpi_strings.library_name(), mpi_strings.processor_name()
    assert set(version + host) <= ALLOWED and "\n" not in name and "\n" not in host
    assert version.startswith(name) and name.startswith(MPI.get_vendor()[0])
    assert host and host in MPI.Get_processor_name()


def test_the_trace_stores_open_mpis_version_without_its_nul(monkeypatch, tmp_path):
    fake = SimpleNamespace(Get_library_version=lambda: OPEN_MPI_VERSION)
    with h5py.File(tmp_path / "raw.h5", "w") as f, pytest.raises(ValueError, match="embedded NULL"):
        f.attrs["mpi_library"] = OPEN_MPI_VERSION  # what the trace did before cleaning
    monkeypatch.setattr(mpi_strings, "MPI", fake)
    TraceWriter(str(tmp_path / "t.h5"), {}, ["h"] * 2).close()
    with h5py.File(tmp_path / "t.h5", "r") as f:
        assert text_attributes(f)["mpi_library"] == OPEN_MPI_VERSION[:-1]
