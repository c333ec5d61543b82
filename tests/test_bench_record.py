"""spar_comm.bench's shared pieces: the record every benchmark writes and the
slowest rank's figures."""
from __future__ import annotations

import datetime
import shlex
import sys

import numpy as np
import pytest
from mpi4py import MPI

import spar_comm
from spar_comm.bench import record, timing
from spar_comm.files import read_json, unwritable


def test_meta_holds_the_common_fields_then_the_tools_own(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["drivers/bench_x.py", "--out", "a b.json"])
    meta = record.meta("bench_x", ["node2", "node1", "node2"], world_size=4, created="then")
    assert list(meta)[:5] == list(record.COMMON) and meta["tool"] == "bench_x"
    assert meta["command"] == "drivers/bench_x.py --out 'a b.json'" and shlex.split(meta["command"])[-1] == "a b.json"
    assert meta["hosts"] == ["node1", "node2"] and meta["world_size"] == 4 and meta["created"] == "then"
    assert datetime.datetime.fromisoformat(meta["date"]).utcoffset() == datetime.timedelta(0)
    versions = meta["versions"]
    assert versions["spar_comm"] == spar_comm.__version__ and versions["numpy"] == np.__version__
    assert {"python", "mpi4py", "mpi_library"} <= set(versions) and versions["mpi_library"]
    assert ("torch" in versions) == ("torch" in sys.modules)  # never imported for the record
    with pytest.raises(ValueError, match="date"):
        record.meta("bench_x", None, date="yesterday")  # a tool cannot overwrite a common field


def test_a_record_is_written_whole_and_read_back_checked(tmp_path):
    path = tmp_path / "out.json"
    meta = record.meta("bench_x")
    record.write_record(path, meta, results=[{"time_median": 0.5}])
    assert read_json(path) == {"meta": meta, "results": [{"time_median": 0.5}]}
    assert unwritable(path) is None
    assert "cannot write --out" in unwritable(tmp_path / "no" / "such.json")


def test_the_slowest_rank_and_its_median():
    times = np.array([[3.0, 1.0, 2.0, 10.0], [1.0, 1.0, 1.0, 1.0]])
    assert (timing.slowest(MPI.COMM_SELF, times) == times).all()
    assert timing.slowest_median(MPI.COMM_SELF, times).tolist() == [2.5, 1.0]  # along the rounds
    assert timing.slowest_median(MPI.COMM_SELF, times[0]) == 2.5
    assert timing.rotated(3, 4) == [1, 2, 0]
