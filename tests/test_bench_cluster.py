"""drivers/bench_cluster.py without a cluster: its report of a sweep (spar_comm.bench.cluster), and bad input.

The sweep itself needs root and network namespaces (tests/test_emucluster.py
covers the harness); here the report is fed cells the cost model itself
produced, so fitting on the smallest size must predict the larger ones."""
from __future__ import annotations

import json

import pytest

from spar_comm import ALGORITHMS, costmodel
from spar_comm.bench.cluster import DENSE, NODE_SWEEP

pytestmark = pytest.mark.alone  # it runs on an emulated cluster


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


def modelled_node_sweep() -> dict:
    """A --sweep nodes document whose cells the model made: 100 Mbit/s and 1 Gbit/s
    links, and unshaped ones (no inter-node bandwidth cost), with the bytes
    the links counted 5% above the package's count."""
    records = []
    for rate, gbps in (("100mbit", 0.1), ("1gbit", 1.0), ("unshaped", None)):
        machine = costmodel.CPU.with_links(inter_gbps=gbps) if gbps else costmodel.CPU.replace(beta_inter=0.0)
        for hosts, ranks in NODE_SWEEP["layouts"]:
            for size in NODE_SWEEP["sizes"]:
                for algorithm in ALGORITHMS:
                    cluster = costmodel.Cluster(hosts, ranks)
                    terms = costmodel.step_terms(algorithm, cluster, size, "float32", 0.001, "mstopk")
                    select = sum(machine.seconds({t: a}) for t, a in terms.items() if t.startswith("select"))
                    inter = 1000 * hosts * ranks
                    records.append({"layout": f"{hosts}x{ranks}", "hosts": hosts, "ranks_per_host": ranks,
                                    "rate": rate, "rate_bps": gbps and gbps * 1e9, "density": 0.001,
                                    "selector": "mstopk", "algorithm": algorithm, "size": size,
                                    "time_median": machine.seconds(terms), "t_select": select,
                                    "bytes_inter_all_ranks": inter, "link_bytes": int(1.05 * inter)})
    return {"meta": {"sweep": "nodes"}, "records": records, "training": []}


@pytest.mark.slow
def test_the_node_sweep_model_is_fitted_on_few_hosts_and_predicts_the_rest(run_driver, tmp_path):
    path, png = tmp_path / "nodes.json", tmp_path / "nodes.png"
    path.write_text(json.dumps(modelled_node_sweep()))
    result = run_driver("bench_cluster.py", "--report", path, "--plot", png)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    held_out = [line.split() for line in lines if len(line.split()) == 8 and line.split()[1] in ("100mbit", "1gbit")
                and line.split()[4] in ALGORITHMS]
    assert {row[0] for row in held_out} == {"8x1", "16x1", "8x2"}  # never a cell of 2 or 4 hosts
    assert len(held_out) == 2 * 3 * 2 * len(ALGORITHMS)  # rates x layouts x sizes x algorithms
    per_algorithm = [line.split() for line in lines if line.startswith("  ") and "worst" in line]
    assert [row[0] for row in per_algorithm] == list(ALGORITHMS)
    assert all(float(row[4].rstrip("%,")) <= 5 for row in per_algorithm), per_algorithm
    # unshaped time as a share of the shaped one, per cell
    document = modelled_node_sweep()
    cell = {(r["rate"], r["layout"], r["size"], r["algorithm"]): r["time_median"] for r in document["records"]}
    share = cell[("unshaped", "16x1", 1 << 22, "topka")] / cell[("100mbit", "16x1", 1 << 22, "topka")]
    row = next(line.split() for line in lines if line.split()[:3] == ["16x1", str(1 << 22), "topka"] and "%" in line)
    assert row[4] == f"{share:.0%}"
    links = next(line.split() for line in lines if line.split()[:3] == ["16x1", str(1 << 22), "gtopk"] and "%" not in line)
    assert links[3:] == ["0.017", "0.016", "1.05"]
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"


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
    (["--sweep", "hosts"], "--sweep: invalid choice"),
    (["--plot", "/no/such/folder/x.png"], "cannot write --plot"),
])
@pytest.mark.slow
def test_bad_arguments_exit_2(run_driver, args, words):
    result = run_driver("bench_cluster.py", *args)
    assert result.returncode == 2 and words in result.stderr, result.stderr
