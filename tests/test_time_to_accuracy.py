"""Time to accuracy without a cluster: the accuracy-against-wall-time panel of
analyze.py --plot drawn from traces, and bench_cluster.py's table of a
--time-to-accuracy document (medians over runs, speed-ups over dense, cells
that miss)."""
from __future__ import annotations

import json

import numpy as np

from spar_comm.bench.cluster import trace_figures
from spar_comm.training.analysis import summarize, time_to_accuracy
from spar_comm.training.trace import FIELDS, TraceWriter, read_trace


ATTRS = dict(world_size=2, algorithm="hitopk", selector="mstopk", density=0.001, test_metric_name="accuracy",
             config=json.dumps({"batch_size": 32}))


def write_trace(path, algorithm, walls, metrics):
    writer = TraceWriter(str(path), {**ATTRS, "algorithm": algorithm}, ["a", "b"])
    writer.append(np.arange(4), np.ones((4, 2, len(FIELDS))))
    for i, (wall, metric) in enumerate(zip(walls, metrics)):
        writer.add_eval(step=i + 1, epoch=i + 1, train_loss=1.0, test_metric=metric, wall=wall)
    writer.close()
    return read_trace(str(path))


def test_trace_figures_time_the_first_evaluation_at_the_target(tmp_path):
    trace = write_trace(tmp_path / "t.h5", "hitopk", [1.0, 2.5, 4.0], [0.9, 0.951, 0.94])
    figures = trace_figures(trace.data, 0.95)
    assert (figures["seconds_to_target"], figures["epoch_to_target"], figures["steps_to_target"]) == (2.5, 2, 2)
    assert figures["final_metric"] == 0.94 and figures["total_seconds"] == 4.0
    assert figures["median_step_seconds"] == 1.0  # every phase of the written rows is 1
    assert trace_figures(trace.data, 0.99)["seconds_to_target"] is None


def test_the_panel_draws_each_traces_accuracy_against_its_wall_time(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = [write_trace(tmp_path / "d.h5", "dense", [1.0, 2.0, 3.0], [0.5, 0.9, 0.96]),
              write_trace(tmp_path / "h.h5", "hitopk", [0.4, 0.8], [0.6, 0.95])]
    summaries = [summarize(t) for t in traces]
    fig, axes = plt.subplots()
    time_to_accuracy(axes, traces, summaries)
    lines = axes.get_lines()
    assert [line.get_label() for line in lines] == ["dense", "hitopk/mstopk"]
    assert lines[0].get_xdata().tolist() == [1.0, 2.0, 3.0] and lines[0].get_ydata().tolist() == [0.5, 0.9, 0.96]
    assert lines[1].get_xdata().tolist() == [0.4, 0.8] and lines[1].get_ydata().tolist() == [0.6, 0.95]
    assert axes.get_ylabel() == "held-out accuracy" and axes.get_xlabel() == "wall time (s)"
    plt.close(fig)


def run(algorithm, seconds, rate="1gbit", epoch=3, step_seconds=0.1):
    return {"layout": "2x2", "rate": rate, "algorithm": algorithm, "target": 0.95, "workload": "--hidden 1024",
            "seconds_to_target": seconds, "epoch_to_target": epoch if seconds is not None else None,
            "steps_to_target": 10 * epoch if seconds is not None else None, "median_step_seconds": step_seconds,
            "final_metric": 0.97, "total_seconds": 20.0, "epochs": 10.0, "bytes_inter": 123_000_000, "trace": None}


def test_report_of_a_time_to_accuracy_run_gives_speedups_over_dense_and_keeps_misses(run_driver, tmp_path):
    document = {"meta": {}, "records": [], "training": [], "time_to_accuracy": [
        run("dense", 12.0, step_seconds=0.4), run("hitopk", 3.0, step_seconds=0.05), run("topka", None),
        run("dense", 40.0, "100mbit"), run("hitopk", 4.0, "100mbit"),
        run("dense", 44.0, "100mbit"), run("hitopk", 40.0, "100mbit"), run("hitopk", 3.0, "100mbit"),
    ]}
    path = tmp_path / "tta.json"
    path.write_text(json.dumps(document))
    result = run_driver("bench_cluster.py", "--report", path)
    assert result.returncode == 0, result.stderr
    rows = {tuple(line.split()[:3]): line.split() for line in result.stdout.splitlines() if line.startswith("   2x2")}
    # measured s, speed-up, estimated s (30 steps x median step), speed-up, epochs
    assert rows[("2x2", "1gbit", "hitopk")][3:8] == ["3.00", "4.00x", "1.50", "8.00x", "3"]
    assert rows[("2x2", "100mbit", "hitopk")][3:5] == ["4.00", "10.50x"]  # medians of 3 and 2 runs
    assert rows[("2x2", "100mbit", "hitopk")][-1] == "3"
    assert rows[("2x2", "1gbit", "topka")][3:8] == ["never", "-", "never", "-", "-"]
    assert rows[("2x2", "1gbit", "dense")][-2] == "123.0"  # MB between nodes
