"""drivers/bench_cluster.py without a cluster: its report of a sweep, and bad input.

The sweep itself needs root and network namespaces (tests/test_emucluster.py
covers the harness); here the report is fed cells the cost model itself
produced, so fitting on the smallest size must predict the larger ones."""
from __future__ import annotations

import json

import pytest

from spar_comm import ALGORITHMS, costmodel

DENSE = ("dense", "hier_dense")


def modelled_sweep() -> dict:
    machine = costmodel.CPU.with_links(inter_gbps=1)
    records = []
    for hosts, ranks in ((2, 2), (4, 1)):
        for size in (1 << 22, 1 << 24):
            for density in (0.001, 0.01):
                for algorithm in ALGORITHMS:
                    if algorithm in DENSE and density != 0.001:
                        continue  # dense cells run at the first density only
                    terms = costmodel.step_terms(algorithm, costmodel.Cluster(hosts, ranks), size, "float32",
                                                 density, "mstopk")
                    select = sum(machine.seconds({t: a}) for t, a in terms.items() if t.startswith("select"))
                    records.append({"layout": f"{hosts}x{ranks}", "hosts": hosts, "ranks_per_host": ranks,
                                    "rate": "1gbit", "rate_bps": 1e9, "density": density, "selector": "mstopk",
                                    "algorithm": algorithm, "size": size, "time_median": machine.seconds(terms),
                                    "t_select": select})
    return {"meta": {}, "records": records, "training": []}


def test_report_prints_every_cell_and_the_model_predicts_its_own_cells(run_driver, tmp_path):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(modelled_sweep()))
    result = run_driver("bench_cluster.py", "--report", path)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    cells = [line for line in lines if line.split()[:2] in (["2x2", "1gbit"], ["4x1", "1gbit"])]
    assert len([c for c in cells if len(c.split()) == 4 + len(ALGORITHMS)]) == 2 * 2 * 2  # layouts x sizes x densities
    summary = [line for line in lines if line.startswith("median error")]
    assert summary, result.stdout
    error = float(summary[0].split()[2].rstrip("%"))
    assert error <= 5, summary[0]


@pytest.mark.parametrize("args, words", [
    (["--repeat", "0"], "--repeat: must be >= 1"),
    (["--dense-repeat", "-1"], "--dense-repeat: must be >= 1"),
    (["--layouts", "2y2"], "layouts"),
    (["--rates", "fast"], "rate"),
    (["--train", "dense,fast"], "unknown algorithm(s) fast"),
])
def test_bad_arguments_exit_2(run_driver, args, words):
    result = run_driver("bench_cluster.py", *args)
    assert result.returncode == 2 and words in result.stderr, result.stderr
