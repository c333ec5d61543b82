"""drivers/bench_jax.py end to end: a small run under mpiexec, and bad input."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")


@pytest.mark.slow
def test_small_run_times_both_paths(run_driver, tmp_path):
    out = tmp_path / "jax.json"
    result = run_driver("bench_jax.py", "--ranks-per-node", 1, "--sizes", "1000,4099", "--algorithms", "dense,topka",
                        "--repeat", 2, "--warmup", 1, "--out", out, ranks=2)
    assert result.returncode == 0, result.stderr
    document = json.loads(out.read_text())
    assert document["meta"]["world_size"] == 2 and document["meta"]["tool"] == "bench_jax"
    rows = {(row["algorithm"], row["size"]): row for row in document["results"]}
    assert set(rows) == {(a, n) for a in ("dense", "topka") for n in (1000, 4099)}
    for row in rows.values():
        assert row["jax_update_s"] > 0 and row["allreducer_s"] > 0
        assert row["overhead"] == pytest.approx(row["jax_update_s"] / row["allreducer_s"])


@pytest.mark.slow
@pytest.mark.parametrize("args, words", [
    (["--sizes", "0"], "every item must be an integer >= 1"),
    (["--algorithms", "dense,fast"], "every item must be one of"),
    (["--out", "/no/such/folder/x.json"], "cannot write --out"),
])
def test_bad_input_exits_2_with_a_message(run_driver, args, words):
    result = run_driver("bench_jax.py", *args)
    assert result.returncode == 2
    assert words in result.stderr and "Traceback" not in result.stderr
