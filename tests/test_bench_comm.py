"""drivers/bench_comm.py end to end: a small run under mpiexec, and bad input."""
from __future__ import annotations

import json
import re

import pytest

from spar_comm import ALGORITHMS


@pytest.mark.slow
def test_small_run_measures_every_algorithm(run_driver, tmp_path):
    out = tmp_path / "bench.json"
    result = run_driver("bench_comm.py", "--ranks-per-node", 1, "--sizes", "1000,4099", "--density", 0.01,
                        "--selector", "exact", "--repeat", 2, "--warmup", 1, "--out", out, ranks=2)
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["meta"]["world_size"] == 2 and document["meta"]["num_nodes"] == 2
    rows = {(row["algorithm"], row["size"]): row for row in document["results"]}
    assert set(rows) == {(a, n) for a in ALGORITHMS for n in (1000, 4099)}
    # two single-rank nodes: everything crosses nodes, and dense sends (p-1)/p*2 of the vector
    assert rows["dense", 4099]["bytes_inter"] == 4099 * 4 and rows["dense", 4099]["bytes_intra"] == 0
    # 41 pairs: 164 bytes of values padded to 168, then 164 bytes of indices, padded to 336
    assert rows["topka", 4099]["bytes_inter"] == 336
    assert all(row["time_median"] > 0 and row["cpu_median"] > 0 for row in rows.values())
    assert all(0 < row["t_check"] <= row["time_median"] for row in rows.values())  # a part of the call
    for row in rows.values():  # reads: over one read of the same vector, timed in the same rounds
        assert row["read_median"] > 0 and row["time_reads"] == pytest.approx(row["time_median"] / row["read_median"])
        assert row["cpu_reads"] == pytest.approx(row["cpu_median"] / row["read_median"])
    assert len({row["read_median"] for row in rows.values() if row["size"] == 4099}) == 1  # one read a size
    for algorithm in ALGORITHMS:  # one table line per algorithm and size
        assert len(re.findall(rf"^\s*\d+ {algorithm} ", result.stdout, re.M)) == 2, result.stdout


@pytest.mark.slow
def test_deadlines_both_measures_each_allreducer_each_way_in_the_same_rounds(run_driver, tmp_path):
    out = tmp_path / "bench.json"
    result = run_driver("bench_comm.py", "--ranks-per-node", 1, "--sizes", "4099", "--algorithms", "dense,hitopk",
                        "--selector", "exact", "--deadlines", "both", "--repeat", 3, "--warmup", 1, "--out", out,
                        ranks=2)
    assert result.returncode == 0, result.stderr
    rows = {(row["algorithm"], row["deadlines"]): row for row in json.loads(out.read_text())["results"]}
    assert set(rows) == {(a, on) for a in ("dense", "hitopk") for on in (True, False)}
    for algorithm in ("dense", "hitopk"):  # one allreducer, the same messages either way
        assert rows[algorithm, True]["bytes_inter"] == rows[algorithm, False]["bytes_inter"] > 0
        assert rows[algorithm, True]["times"] != rows[algorithm, False]["times"]
        for way in ("on", "off"):
            assert len(re.findall(rf"^\s*4099 {algorithm} {way} ", result.stdout, re.M)) == 1, result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("in_place", [False, True])
def test_count_passes_counts_the_zero_fill_apart_or_riding_on_the_sweep(run_driver, tmp_path, in_place):
    """Past ``4 * SAMPLE`` values the selectors sweep; in place, the sweep also
    zeroes the gradient for the result, where ``out`` apart takes a zero-fill."""
    out = tmp_path / "bench.json"
    result = run_driver("bench_comm.py", "--ranks-per-node", 1, "--sizes", 300_001, "--algorithms", "dense,topka",
                        "--density", 0.001, "--repeat", 2, "--warmup", 1, "--count-passes", "--out", out,
                        *(["--in-place"] if in_place else []), ranks=2)
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["meta"]["in_place"] is in_place
    rows = {row["algorithm"]: row for row in document["results"]}
    topka = rows["topka"]
    assert (topka["pass_count"], topka["pass_reads"], topka["pass_writes"]) == (
        2 if in_place else 3, pytest.approx(3, abs=0.01), pytest.approx(2, abs=0.01))
    assert rows["dense"]["bytes_inter"] == 300_001 * 4 and topka["bytes_inter"] > 0  # the calls reduced


@pytest.mark.slow
def test_a_value_codec_narrows_the_messages_of_the_algorithms_that_take_one(run_driver, tmp_path):
    out = tmp_path / "bench.json"
    result = run_driver("bench_comm.py", "--ranks-per-node", 1, "--sizes", "4099", "--density", 0.01,
                        "--algorithms", "dense,topka,gtopk,hitopk", "--values", "int8", "--selector", "exact",
                        "--repeat", 1, "--warmup", 0, "--out", out, ranks=2)
    assert result.returncode == 0, result.stderr
    assert "int8 values for dense, hier_dense, topka, hitopk, hitopk_leader" in result.stdout
    rows = {row["algorithm"]: row for row in json.loads(out.read_text())["results"]}
    # 41 pairs: one scale (4 bytes) and 41 steps, padded to 48, then 164 bytes of indices, padded to 216
    assert rows["topka"]["bytes_inter"] == 216 and rows["hitopk"]["bytes_inter"] == 216
    # dense: chunks of 2050, 9 scales and 2050 steps, padded to 2088, once in the Alltoall and once in the Allgather
    assert rows["dense"]["bytes_inter"] == 2 * 2088
    assert rows["gtopk"]["bytes_inter"] == 336  # as it always sends


@pytest.mark.slow
def test_the_gpu_path_stages_only_the_pairs_of_the_sparse_algorithms(run_driver, tmp_path):
    """--device gpu-simulator (the GPU path on the CPU, MPI not CUDA-aware):
    dense stages its whole vector out and back, topka its k pairs out and the
    two ranks' records back in."""
    pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")
    out = tmp_path / "bench.json"
    result = run_driver("bench_comm.py", "--ranks-per-node", 1, "--sizes", "4099", "--density", 0.01,
                        "--algorithms", "dense,topka", "--selector", "threshold", "--device", "gpu-simulator",
                        "--repeat", 1, "--warmup", 0, "--out", out, ranks=2, timeout=300,
                        env={"NUMBA_ENABLE_CUDASIM": "1", "SPAR_COMM_CUDA_AWARE": "0"})
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["meta"]["device"] == "gpu-simulator 0, MPI through pinned host buffers"
    staged = {row["algorithm"]: row["bytes_staged"] for row in document["results"]}
    assert staged == {"dense": 2 * 4099 * 4, "topka": 3 * 336}


@pytest.mark.parametrize(
    "args, words",
    [
        (["--sizes", "0"], "every item must be an integer >= 1"),
        (["--sizes", "1k"], "is not a comma-separated list of ints"),
        (["--density", "0"], "density must be in (0, 1]"),
        (["--algorithms", "dense,fast"], "unknown algorithm(s) fast"),
        (["--selector", "nope"], "invalid choice"),
        (["--out", "/no/such/folder/x.json"], "not a writable folder"),
        (["--ranks-per-node", "0"], "--ranks-per-node must be >= 1"),
        (["--device", "tpu"], "invalid choice: 'tpu'"),
        (["--values", "int4"], "invalid choice: 'int4'"),
    ],
)
@pytest.mark.slow
def test_bad_input_exits_2_with_a_message(run_driver, args, words):
    result = run_driver("bench_comm.py", *args)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
