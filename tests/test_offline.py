"""Offline use (docs/design.md, Layout): reading a trace and a checkpoint,
the summary, and drivers/analyze.py, in a process where mpi4py and numba
cannot be imported (a laptop without MPI), give what they give beside MPI,
and never try to import either; so analyze.py leaves /dev/shm as it found
it, where Open MPI leaves a file for every process that initialises it
without mpiexec."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Tuple

import array_api_compat.numpy as xnp
import numpy as np
import pytest
from conftest import ROOT
from shm_cleanup import mpi_segments, orphaned_segments

from spar_comm.costmodel.auto import Pricing
from spar_comm.costmodel.machine import CPU, Cluster
from spar_comm.topology import Topology
from spar_comm.training import TrainConfig, TrainState, build_model, read_trace, save_checkpoint
from spar_comm.training.aids import ScheduledAllreduce
from spar_comm.training.analysis import summarize
from spar_comm.training.data import Shards, load_dataset
from spar_comm.training.density import make_schedule
from spar_comm.training.distributed import Group
from spar_comm.training.trace import FIELDS, TraceWriter

BLOCKED = ("mpi4py", "numba")
#: Any attempt to import a blocked package is logged with its stack, then refused.
SHIM = """import os, traceback
with open(os.environ["BLOCKED_LOG"], "a") as log:
    log.write(f"import {__name__}\\n" + "".join(traceback.format_stack()))
raise ImportError(f"{__name__} is blocked in this test")
"""
#: What an analysis script does: the names it imports, a trace summarized, a checkpoint read by parameter name.
READER = """import json, sys
import array_api_compat.numpy as xnp
import h5py
from spar_comm.training import TrainConfig, build_model, read_trace
from spar_comm.training.analysis import summarize
from spar_comm.training.checkpoint import read_checkpoint
from spar_comm.training.data import load_dataset

trace, checkpoint = sys.argv[1:]
with h5py.File(checkpoint, "r") as f:
    config = TrainConfig.from_json(f.attrs["config"])
layout = build_model(config, load_dataset(config.dataset, config.dtype), xnp, "cpu").layout
saved = read_checkpoint(checkpoint, 0, layout)
json.dump(dict(summary=summarize(read_trace(trace)), step=saved.step, params=saved.params.tobytes().hex(),
               residual=saved.residual.tobytes().hex(),
               loaded=sorted(m for m in sys.modules if m.split(".")[0] in ("mpi4py", "numba"))), sys.stdout)
"""
STEPS = 6


@pytest.fixture(scope="module")
def blocked(tmp_path_factory) -> dict:
    """The environment of a process in which mpi4py and numba cannot be imported."""
    folder = tmp_path_factory.mktemp("blocked")
    for name in BLOCKED:
        (folder / name).mkdir()
        (folder / name / "__init__.py").write_text(SHIM)
    path = os.pathsep.join(filter(None, [str(folder), str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "BLOCKED_LOG": str(folder / "imports.log")}


def run(env: dict, *args: str) -> Tuple[subprocess.CompletedProcess, str]:
    """Python with ``args`` in ``env``, and the stack of each import of a
    blocked package it tried ("": none)."""
    log = Path(env["BLOCKED_LOG"])
    log.unlink(missing_ok=True)
    result = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return result, log.read_text() if log.exists() else ""


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict:
    """A trace and a checkpoint of a softmax regression on the digits, written by the package."""
    folder = tmp_path_factory.mktemp("files")
    trace, checkpoint = str(folder / "trace.h5"), str(folder / "ck.h5")
    rng = np.random.default_rng(0)
    block = rng.uniform(1e-4, 1e-2, (STEPS, 2, len(FIELDS)))  # [step, rank, field]
    config = TrainConfig(algorithm="topka", model="softmax", density=0.1)
    attrs = dict(world_size=2, algorithm="topka", selector="mstopk", density=0.1, test_metric_name="accuracy",
                 config=config.to_json())
    writer = TraceWriter(trace, attrs, ["a", "b"])
    writer.append(np.arange(STEPS), block)
    writer.add_eval(step=STEPS, epoch=1.0, train_loss=0.5, test_metric=0.75, wall=1.5)
    writer.close()

    group = Group(Topology(ranks_per_node=1))
    layout = build_model(config, load_dataset(config.dataset, config.dtype), xnp, "cpu").layout
    schedule = make_schedule("fixed", 0.1, 10)
    allreduce = ScheduledAllreduce(group, "topka", layout.size, "float32", "mstopk", schedule)
    allreduce.reduce(0, rng.standard_normal(layout.size).astype(np.float32), np)  # a residual from a real call
    params, velocity = (rng.standard_normal(layout.size).astype(np.float32) for _ in range(2))
    state = TrainState(group, config, layout, params, velocity, allreduce, Shards(100, 0, 1, 10, 0), schedule, step=4)
    save_checkpoint(state, checkpoint)
    # A run of algorithm="auto" keeps what it priced, which a reader checks.
    auto = dataclasses.replace(state, config=dataclasses.replace(config, algorithm="auto"),
                               pricing=Pricing(CPU, Cluster(1, 1, None)))
    save_checkpoint(auto, str(folder / "auto.h5"))
    return dict(trace=trace, checkpoint=checkpoint, auto=str(folder / "auto.h5"), block=block, state=state)


def test_the_blocker_refuses_and_logs_an_import(blocked):
    for name in BLOCKED:
        result, tried = run(blocked, "-c", f"import {name}")
        assert result.returncode == 1 and f"ImportError: {name} is blocked" in result.stderr
        assert tried.startswith(f"import {name}\n")


def test_a_reader_without_mpi_reads_what_one_with_it_reads(blocked, files):
    result, tried = run(blocked, "-c", READER, files["trace"], files["checkpoint"])
    assert result.returncode == 0 and tried == "", result.stderr + tried
    offline = json.loads(result.stdout)
    assert offline["loaded"] == []
    assert offline["summary"] == json.loads(json.dumps(summarize(read_trace(files["trace"]))))
    step_times = np.ascontiguousarray(files["block"][:, :, FIELDS.index("step")])
    assert offline["summary"]["steps"] == STEPS and offline["summary"]["phases"]["step"]["mean"] == step_times.mean()
    state = files["state"]
    assert offline["step"] == 4 and bytes.fromhex(offline["params"]) == state.params.tobytes()
    assert bytes.fromhex(offline["residual"]) == state.allreduce.residual()[1].tobytes()


def test_a_checkpoint_of_auto_is_read_without_mpi_and_keeps_what_it_priced(blocked, files):
    reader = READER.replace("step=saved.step,", "step=saved.step, priced=saved.priced,")
    result, tried = run(blocked, "-c", reader, files["trace"], files["auto"])
    assert result.returncode == 0 and tried == "", result.stderr + tried
    offline = json.loads(result.stdout)
    assert offline["loaded"] == [] and offline["step"] == 4
    assert offline["priced"] == json.loads(json.dumps(Pricing(CPU, Cluster(1, 1, None)).to_state()))


def test_analyze_runs_without_mpi(blocked, files):
    result, tried = run(blocked, "drivers/analyze.py", files["trace"], "--json")
    assert result.returncode == 0 and tried == "", result.stderr + tried
    (summary,) = json.loads(result.stdout)["traces"]
    assert summary == json.loads(json.dumps(summarize(read_trace(files["trace"]))))
    assert summary["test_metric"] == 0.75 and summary["steps"] == STEPS


@pytest.mark.openmpi
@pytest.mark.alone  # it counts the files in /dev/shm
def test_analyze_leaves_dev_shm_as_it_found_it(files):
    before = mpi_segments()
    result = subprocess.run([sys.executable, "drivers/analyze.py", files["trace"]], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0 and "bytes/step per rank" in result.stdout, result.stderr
    assert orphaned_segments(before) == set()  # files of jobs beside it, still mapped, do not count
