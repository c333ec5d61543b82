"""bench_cluster.py's runs on an emulated cluster (root): for each host
layout the cluster is brought up once, and for each link rate the links are
reshaped and drivers/bench_comm.py or drivers/train.py runs across the
hosts; the cluster is removed at the end and on failure. The records go
into the sweep's document, saved after every run, so that a killed sweep
keeps what it measured; ``cluster`` reports them."""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, List, Optional, Sequence, Tuple

from .. import emucluster
from ..training.trace import read_trace
from .cluster import DENSE, trace_figures


@dataclass(frozen=True)
class ClusterSweep:
    """What a sweep runs: the host ``layouts`` (hosts, ranks a host) and link
    ``rates``; bench_comm.py's sizes, densities, algorithms, selector and
    calls (``dense_repeat`` for the dense ones, which do not depend on the
    density); the training runs of ``train`` to ``target`` at
    ``train_rate`` on the first layout; for --time-to-accuracy, the
    ``workload`` (train.py's flags) with ``tta_algorithms`` at ``tta_rates``
    ``tta_repeat`` times, traces kept in ``traces``. ``limit``: seconds a
    run may take; ``prefix``: the name of what the cluster makes."""

    layouts: Sequence[Tuple[int, int]]
    rates: Sequence[str]
    sizes: Sequence[int]
    densities: Sequence[float]
    algorithms: Sequence[str]
    selector: Optional[str]
    repeat: int
    dense_repeat: int
    warmup: int
    limit: float
    prefix: str
    train: Sequence[str]
    train_rate: str
    target: float
    skip_bench: bool
    tta_algorithms: Sequence[str]
    tta_rates: Sequence[str]
    workload: str
    traces: Optional[str]
    tta_repeat: int


@contextlib.contextmanager
def cluster_up(hosts: int, ranks: int, rate: str, prefix: str) -> Iterator[emucluster.ClusterSpec]:
    """An emulated cluster of ``hosts`` x ``ranks`` at ``rate``, made anew (what
    ``prefix`` names is removed first) and removed after, whatever happens."""
    emucluster.down(prefix)
    spec = emucluster.up(emucluster.ClusterSpec(hosts, ranks, rate, "0us", prefix))
    try:
        yield spec
    finally:
        emucluster.down(prefix)


def run_bench_comm(drivers: Path, spec: emucluster.ClusterSpec, sweep: ClusterSweep, density: float,
                   algorithms: List[str], repeat: int) -> dict:
    """drivers/bench_comm.py across the emulated hosts, with the bytes on their
    links counted; returns its JSON document."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "bench.json")
        command = [sys.executable, str(drivers / "bench_comm.py"), "--sizes", ",".join(map(str, sweep.sizes)),
                   "--density", str(density), "--algorithms", ",".join(algorithms),
                   "--repeat", str(repeat), "--warmup", str(sweep.warmup), "--out", out,
                   "--link-counters", emucluster.IFACE]
        if sweep.selector:
            command += ["--selector", sweep.selector]
        result = emucluster.run(spec, command, timeout=sweep.limit)
        if result.returncode != 0:
            raise RuntimeError(f"bench_comm failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return json.loads(Path(out).read_text())


def time_to_accuracy(drivers: Path, spec: emucluster.ClusterSpec, algorithm: str, target: float, limit: float,
                     workload: Sequence[str] = (), keep: Optional[str] = None) -> dict:
    """A training run (train.py's defaults, or ``workload``'s flags) across the
    emulated hosts: wall seconds and epochs until the held-out accuracy first
    reaches ``target``, the final accuracy and the bytes sent between nodes,
    from the run's trace (kept at ``keep`` when given)."""
    with tempfile.TemporaryDirectory() as folder:
        trace_path = keep or os.path.join(folder, "train.h5")
        command = [sys.executable, str(drivers / "train.py"), *workload, "--algorithm", algorithm,
                   "--ranks-per-node", "0", "--trace", trace_path, "--no-progress"]
        result = emucluster.run(spec, command, timeout=limit)
        if result.returncode != 0:
            raise RuntimeError(f"train.py failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
        return {"algorithm": algorithm, **trace_figures(read_trace(trace_path).data, target),
                "summary": result.stdout.strip().splitlines()[-1]}


def bench_sweep(drivers: Path, sweep: ClusterSweep, document: dict, progress: Callable[[str], None],
                save: Callable[[], None]) -> None:
    """bench_comm.py on every layout at every rate (the dense algorithms once
    a rate, at the first density), then the training runs on the first
    layout; the records into ``document``, ``save`` called after every run."""
    dense = [a for a in sweep.algorithms if a in DENSE]
    sparse = [a for a in sweep.algorithms if a not in DENSE]
    runs = [(sweep.densities[0], dense, sweep.dense_repeat)] if dense else []  # the density does not matter
    runs += [(density, sparse, sweep.repeat) for density in sweep.densities] if sparse else []
    for number, (hosts, ranks) in enumerate(sweep.layouts):
        with cluster_up(hosts, ranks, sweep.rates[0], sweep.prefix) as spec:
            for rate in [] if sweep.skip_bench else sweep.rates:
                spec = emucluster.reshape(spec, rate, "0us")
                for density, algorithms, repeat in runs:
                    progress(f"# {hosts}x{ranks} at {rate}, density {density}: {', '.join(algorithms)}")
                    result = run_bench_comm(drivers, spec, sweep, density, algorithms, repeat)
                    for row in result["results"]:
                        document["records"].append({
                            "layout": f"{hosts}x{ranks}", "hosts": hosts, "ranks_per_host": ranks,
                            "cores": len(os.sched_getaffinity(0)), "rate": rate,
                            "rate_bps": _finite(emucluster.rate_bits_per_second(rate)), "density": density,
                            "selector": result["meta"]["selector"], **row})
                    document["bench_comm_meta"] = result["meta"]
                    save()
            if number == 0 and sweep.train:
                spec = emucluster.reshape(spec, sweep.train_rate, "0us")
                for algorithm in sweep.train:
                    progress(f"# training with {algorithm} on {hosts}x{ranks} at {sweep.train_rate}")
                    run = time_to_accuracy(drivers, spec, algorithm, sweep.target, sweep.limit)
                    document["training"].append({"layout": f"{hosts}x{ranks}", "rate": sweep.train_rate, **run})
                    save()


def time_to_accuracy_sweep(drivers: Path, sweep: ClusterSweep, document: dict, progress: Callable[[str], None],
                           save: Callable[[], None]) -> None:
    """The workload with every algorithm, layout and rate, the algorithms
    interleaved run by run; the runs into ``document``, ``save`` called after
    every run."""
    workload = sweep.workload.split()
    if sweep.traces:
        os.makedirs(sweep.traces, exist_ok=True)
    for hosts, ranks in sweep.layouts:
        with cluster_up(hosts, ranks, sweep.tta_rates[0], sweep.prefix) as spec:
            for rate in sweep.tta_rates:
                spec = emucluster.reshape(spec, rate, "0us")
                for repeat, algorithm in itertools.product(range(sweep.tta_repeat), sweep.tta_algorithms):
                    progress(f"# time to accuracy: {algorithm} on {hosts}x{ranks} at {rate}, run {repeat + 1}")
                    name = f"{algorithm}-{hosts}x{ranks}-{rate}-{repeat}.h5"
                    keep = os.path.join(sweep.traces, name) if sweep.traces else None
                    run = time_to_accuracy(drivers, spec, algorithm, sweep.target, sweep.limit, workload, keep)
                    document["time_to_accuracy"].append({"layout": f"{hosts}x{ranks}", "rate": rate,
                                                         "repeat": repeat, "workload": sweep.workload,
                                                         "trace": keep, **run})
                    save()


def _finite(value: float) -> Optional[float]:
    """JSON has no infinity: an unshaped link's rate is written as null."""
    return value if value < float("inf") else None
