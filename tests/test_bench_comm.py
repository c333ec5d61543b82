"""drivers/bench_comm.py end to end: a small run under mpiexec, and bad input."""
from __future__ import annotations

import json
import re

import pytest

from spar_comm import ALGORITHMS


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
    assert all(row["time_median"] > 0 for row in rows.values())
    for algorithm in ALGORITHMS:  # one table line per algorithm and size
        assert len(re.findall(rf"^\s*\d+ {algorithm} ", result.stdout, re.M)) == 2, result.stdout


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
    ],
)
def test_bad_input_exits_2_with_a_message(run_driver, args, words):
    result = run_driver("bench_comm.py", *args)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
