"""drivers/bench_waiting.py end to end: both ways of waiting measured, and bad input."""
from __future__ import annotations

from spar_comm.files import read_json


def test_both_ways_are_measured_and_sleeping_costs_less_cpu(run_driver, tmp_path):
    out = tmp_path / "waiting.json"
    result = run_driver("bench_waiting.py", "--late-ms", 20, "--warmup", 1, "--repeat", 5, "--out", out, ranks=2)
    assert result.returncode == 0, result.stderr
    document = read_json(out)
    assert document["meta"]["world_size"] == 2 and document["meta"]["longest_pause"] == 2e-4
    rows = {row["way"]: row for row in document["results"]}
    assert set(rows) == {"sleep", "spin"}
    # the spinning rank burns most of the 20 ms; the sleeping one wakes some
    # hundred times, at tens of microseconds each
    assert rows["sleep"]["cpu_median"] < 0.5 * rows["spin"]["cpu_median"], rows
    assert all(0 < row["after_median"] <= row["after_p90"] for row in rows.values())
    assert [line.split()[0] for line in result.stdout.splitlines()[-2:]] == ["sleep", "spin"]


def test_one_rank_is_refused(run_driver):
    result = run_driver("bench_waiting.py", ranks=1)
    assert result.returncode == 2
    assert "needs at least 2 ranks" in result.stderr


def test_a_bad_option_is_refused(run_driver, tmp_path):
    result = run_driver("bench_waiting.py", "--late-ms", 0)
    assert result.returncode == 2 and "--late-ms" in result.stderr
    result = run_driver("bench_waiting.py", "--out", tmp_path / "missing" / "w.json", ranks=2)
    assert result.returncode == 2 and "not a writable folder" in result.stderr
