"""What runs store of their MPI library, end to end under the MPI that this
Python's mpi4py loads (``make test`` runs it under MPICH and Open MPI): the
library's strings in a trace (which analyze.py reads) and in a benchmark
file, cleaned, and the
calibration fitted on that benchmark giving predict.py the predictions of
the fit itself."""
from __future__ import annotations

import json

import h5py
import pytest

from spar_comm import ALGORITHMS, mpi_strings
from spar_comm.files import text_attributes

pytestmark = pytest.mark.openmpi  # make test-openmpi: the drivers' runs under each library's launcher


@pytest.mark.slow
def test_the_trace_holds_the_librarys_strings_and_analyze_reads_it(run_driver, tmp_path):
    trace = tmp_path / "t.h5"
    result = run_driver("train.py", "--selector", "exact", "--no-progress", "--hidden", "16", "--steps", "3",
                        "--ranks-per-node", "1", "--trace", trace, ranks=2)
    assert result.returncode == 0, result.stderr
    with h5py.File(trace, "r") as f:
        assert text_attributes(f)["mpi_library"] == mpi_strings.library_version()
        assert [h.decode() for h in f["hosts"][:]] == [mpi_strings.processor_name()] * 2
    analysis = run_driver("analyze.py", trace)
    assert analysis.returncode == 0, analysis.stderr
    assert "parameters, 3 steps" in analysis.stdout and "bytes/step per rank" in analysis.stdout, analysis.stdout


@pytest.mark.slow
def test_a_benchmark_holds_the_library_and_its_fit_drives_predict(run_driver, tmp_path):
    bench, calibration = tmp_path / "bench.json", tmp_path / "cal.json"
    result = run_driver("bench_comm.py", "--ranks-per-node", 1, "--sizes", "4096,16384,65536", "--density", 0.01,
                        "--selector", "exact", "--repeat", 2, "--warmup", 1, "--out", bench, ranks=2)
    assert result.returncode == 0, result.stderr
    meta = json.loads(bench.read_text())["meta"]
    assert meta["mpi_library"] == mpi_strings.library_name() and meta["hosts"] == [mpi_strings.processor_name()]
    fit = run_driver("predict.py", "fit", bench, "--out", calibration, "--json")
    assert fit.returncode == 0, fit.stderr
    question = ["--nodes", 2, "--ranks-per-node", 1, "--size", 65536, "--density", 0.01, "--selector", "exact", "--json"]
    from_file = run_driver("predict.py", *question, "--calibration", calibration)
    from_bench = run_driver("predict.py", *question, "--calibration", bench)  # the same fit, made in place
    assert from_file.returncode == 0 and from_bench.returncode == 0, from_file.stderr + from_bench.stderr
    seconds = json.loads(from_file.stdout)["algorithms"]
    assert list(seconds) == list(ALGORITHMS) and all(s > 0 for s in seconds.values())
    assert seconds == json.loads(from_bench.stdout)["algorithms"]
