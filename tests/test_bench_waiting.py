"""drivers/bench_waiting.py end to end: both ways of waiting measured, and bad input."""
from __future__ import annotations

import pytest

from spar_comm.files import read_json

LATE = 0.020  # seconds


def test_both_ways_are_measured_and_sleeping_uses_little_of_the_wait(run_driver, tmp_path):
    out = tmp_path / "waiting.json"
    result = run_driver("bench_waiting.py", "--late-ms", LATE * 1e3, "--warmup", 1, "--repeat", 5, "--out", out,
                        ranks=2)
    assert result.returncode == 0, result.stderr
    document = read_json(out)
    assert document["meta"]["world_size"] == 2 and document["meta"]["longest_pause"] == 2e-4
    rows = {row["way"]: row for row in document["results"]}
    assert set(rows) == {"sleep", "spin"}
    # a rank that sleeps wakes about a hundred times in 20 ms, at tens of µs each
    assert 0 < rows["sleep"]["cpu_median"] < 0.5 * LATE, rows
    # the late rank finds the others waiting: its own call is short either way,
    # and would include the 20 ms if the late arrival were timed by mistake
    assert all(row["after_median"] < 0.5 * LATE for row in rows.values()), rows
    assert [line.split()[0] for line in result.stdout.splitlines()[-2:]] == ["sleep", "spin"]


def test_one_rank_is_refused(run_driver):
    result = run_driver("bench_waiting.py", ranks=1)
    assert result.returncode == 2
    assert "bench_waiting.py: error: needs at least 2 ranks" in result.stderr


@pytest.mark.slow
def test_a_bad_option_is_refused(run_driver, tmp_path):
    for late in ("0", "1e13", "soon"):
        result = run_driver("bench_waiting.py", "--late-ms", late)
        assert result.returncode == 2 and "--late-ms" in result.stderr, result.stderr
    result = run_driver("bench_waiting.py", "--out", tmp_path / "missing" / "w.json", ranks=2)
    assert result.returncode == 2 and "not a writable folder" in result.stderr
