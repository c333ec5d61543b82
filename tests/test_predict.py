"""drivers/predict.py: the table, --json, calibration, sweeps with break-even
points and a plot, the fit with held-out sizes, and bad input (exit status 2)."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import ROOT
from spar_comm import ALGORITHMS
from spar_comm.costmodel import CPU, Cluster, fastest, step_terms
from test_costmodel import synthetic_rows

CLUSTER = ["--nodes", "16", "--ranks-per-node", "8", "--inter-gbps", "25", "--intra-gbps", "1200"]


def predict(*args):
    """``python drivers/predict.py ARGS``: its exit status, and its output as .out and .err."""
    done = subprocess.run([sys.executable, str(ROOT / "drivers" / "predict.py"), *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    return done.returncode, SimpleNamespace(out=done.stdout, err=done.stderr)


def test_table_names_every_algorithm_and_the_fastest():
    code, out = predict(*CLUSTER, "--size", "25.6M")
    assert code == 0
    for name in ALGORITHMS:
        assert f"\n{name} " in out.out
    assert out.out.count("<- fastest") == 1


def test_json_gives_seconds_and_the_best():
    code, out = predict(*CLUSTER, "--size", "1.5B", "--density", "0.01", "--json")
    document = json.loads(out.out)
    assert list(document["algorithms"]) == list(ALGORITHMS)
    assert document["best"] == fastest(document["algorithms"])  # of those that sum
    assert document["size"] == 1_500_000_000


def test_cores_shared_by_the_ranks_price_the_emulated_cluster():
    """--cores 2 for 4 ranks: what step_terms gives for Cluster(2, 2, cores=2)."""
    point = ["--nodes", "2", "--ranks-per-node", "2", "--inter-gbps", "1", "--intra-gbps", "80", "--preset", "cpu",
             "--size", "6.5M", "--density", "0.1", "--selector", "threshold", "--json"]
    shared = json.loads(predict(*point, "--cores", "2")[1].out)["algorithms"]
    owned = json.loads(predict(*point)[1].out)["algorithms"]
    machine = CPU.with_links(inter_gbps=1, intra_gbps=80)
    for name in ("hier_dense", "hitopk"):
        expected = machine.seconds(step_terms(name, Cluster(2, 2, cores=2), 6_500_000, density=0.1, selector="threshold"))
        assert shared[name] == pytest.approx(expected) and shared[name] > owned[name]


def write_bench(path, rows):
    """rows of one cluster shape as bench_comm.py writes them."""
    cluster = rows[0].cluster
    meta = {"num_nodes": cluster.nodes, "ranks_per_node": cluster.ranks_per_node, "node_sizes": [cluster.ranks_per_node] * cluster.nodes,
            "dtype": "float32", "density": 0.001, "selector": "mstopk"}
    results = [{"algorithm": r.algorithm, "size": r.size, "time_median": r.seconds, "t_select": r.select_seconds}
               for r in rows if r.cluster == cluster]
    path.write_text(json.dumps({"meta": meta, "results": results}))


def test_fit_reports_held_out_error_and_its_calibration_drives_predictions(tmp_path):
    bench = tmp_path / "bench.json"
    write_bench(bench, synthetic_rows(CPU, [2**16, 2**17, 2**18, 2**20]))
    code, out = predict("fit", bench, "--holdout-sizes", "131072", "--out", tmp_path / "cal.json", "--json")
    summary = json.loads(out.out)
    assert code == 0 and summary["holdout_sizes"] == [131072] and summary["holdout_median_relative_error"] < 0.05
    code, out = predict("--nodes", 2, "--ranks-per-node", 2, "--size", "1M", "--calibration", tmp_path / "cal.json", "--json")
    assert code == 0 and json.loads(out.out)["best"] in ALGORITHMS


@pytest.mark.slow
@pytest.mark.parametrize("sweep", ["density", "size", "nodes"])
def test_sweep_prints_break_even_points_and_writes_a_plot(tmp_path, sweep):
    png = tmp_path / f"{sweep}.png"
    code, out = predict(*CLUSTER, "--size", "25.6M", "--sweep", sweep, "--plot", png)
    assert code == 0 and "break-even points" in out.out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_size_sweep_finds_where_sparse_overtakes_dense():
    code, out = predict(*CLUSTER, "--size", "1M", "--sweep", "size", "--json")
    crossings = json.loads(out.out)["break_even"]
    assert crossings and crossings[0]["from"] in ("dense", "hier_dense")


BAD_INPUT = [
    ([*CLUSTER, "--size", "0"], "size must be a whole number"),
    ([*CLUSTER, "--size", "-5"], "positive element count"),
    ([*CLUSTER, "--size", "1.5"], "whole number"),
    ([*CLUSTER, "--size", "10", "--density", "0"], "density must be in (0, 1]"),
    ([*CLUSTER, "--size", "10", "--density", "1.5"], "density must be in (0, 1]"),
    ([*CLUSTER, "--size", "10", "--density", "nan"], "positive finite"),
    (["--nodes", "0", "--ranks-per-node", "8", "--inter-gbps", "25", "--intra-gbps", "1", "--size", "10"], "must be >= 1"),
    (["--nodes", "2", "--ranks-per-node", "-1", "--inter-gbps", "25", "--intra-gbps", "1", "--size", "10"], "must be >= 1"),
    ([*CLUSTER, "--size", "10", "--cores", "0"], "must be >= 1"),
    (["--nodes", "2", "--ranks-per-node", "8", "--inter-gbps", "0", "--intra-gbps", "1", "--size", "10"], "positive finite"),
    (["--nodes", "2", "--ranks-per-node", "8", "--inter-gbps", "25", "--intra-gbps", "-3", "--size", "10"], "positive finite"),
    (["--nodes", "2", "--ranks-per-node", "8", "--size", "10"], "required without --calibration"),
    ([*CLUSTER, "--size", "10", "--plot", "x.png"], "--plot needs --sweep"),
    ([*CLUSTER, "--size", "10", "--calibration", "/no/such.json"], "cannot read"),
    (["fit", "/no/such.json"], "cannot read"),
]
#: Each case starts predict.py: the quick tier runs one of each kind (size, density, counts, rates, files).
QUICK = {0, 3, 6, 9, 13}


@pytest.mark.parametrize("args, words", [case if i in QUICK else pytest.param(*case, marks=pytest.mark.slow)
                                         for i, case in enumerate(BAD_INPUT)])
def test_bad_input_exits_2_with_a_message(args, words):
    code, out = predict(*args)
    assert code == 2 and words in out.err and "Traceback" not in out.err


def test_foreign_calibration_file_exits_2(tmp_path):
    foreign = tmp_path / "foreign.json"
    foreign.write_text(json.dumps({"hello": "world"}))
    code, out = predict(*CLUSTER, "--size", "10", "--calibration", foreign)
    assert code == 2 and "neither bench_comm.py" in out.err


def test_bad_input_from_the_command_line_has_no_traceback(run_driver):
    result = run_driver("predict.py", *CLUSTER, "--size", "10", "--density", "2")
    assert result.returncode == 2 and "density must be in (0, 1]" in result.stderr
    assert "Traceback" not in result.stderr
