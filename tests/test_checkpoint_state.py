"""save_checkpoint(path, state): the run's state as one value, written and
read back to the same bits; the older twelve-argument form still writes the
same file, with a DeprecationWarning that names the new call."""
from __future__ import annotations

import h5py
import numpy as np
import pytest

from spar_comm.topology import Topology
from spar_comm.training import TrainConfig, TrainState, save_checkpoint
from spar_comm.training.aids import ScheduledAllreduce
from spar_comm.training.checkpoint import load_checkpoint, read_saved
from spar_comm.training.data import Shards
from spar_comm.training.density import make_schedule
from spar_comm.training.distributed import Group
from spar_comm.training.layout import ParamLayout

LAYOUT = ParamLayout([("w", (30, 8)), ("b", (8,))])


def fresh_state(seed: int) -> TrainState:
    """A world-of-one run's state after some steps: every array filled from ``seed``."""
    config = TrainConfig(algorithm="topka", density=0.1, density_schedule="accordion", accordion_high=0.25)
    group = Group(Topology(ranks_per_node=1))
    rng = np.random.default_rng(seed)
    schedule = make_schedule("accordion", 0.1, 12, high=0.25)
    allreduce = ScheduledAllreduce(group, "topka", LAYOUT.size, "float32", "mstopk", schedule)
    grad = rng.standard_normal(LAYOUT.size).astype(np.float32)
    allreduce.reduce(0, grad, np)  # a residual and the schedule's accumulated update from a real call
    params, velocity = (rng.standard_normal(LAYOUT.size).astype(np.float32) for _ in range(2))
    shards = Shards(240, 0, 1, 20, seed=3)
    return TrainState(group, config, LAYOUT, params, velocity, allreduce, shards, schedule, step=7)


def contents(path) -> dict:
    """Every dataset and attribute of a checkpoint but its date and seals."""
    found = {}
    with h5py.File(path, "r") as f:
        def visit(name, item):
            for key, value in item.attrs.items():
                if key not in ("created", "sha256"):
                    found[f"{name}@{key}"] = np.asarray(value).tobytes() if not isinstance(value, str) else value
            if isinstance(item, h5py.Dataset):
                found[name] = item[()].tobytes()
        f.visititems(visit)
        visit("/", f)
    return found


def test_a_state_comes_back_to_the_bit(tmp_path):
    path = str(tmp_path / "ck.h5")
    state = fresh_state(1)
    save_checkpoint(path, state)
    other = fresh_state(2)  # every array differs before the load
    assert not np.array_equal(other.params, state.params)
    load_checkpoint(read_saved(path, other.group, LAYOUT), path, other)
    assert other.step == 7
    for name in ("params", "velocity"):
        assert getattr(other, name).tobytes() == getattr(state, name).tobytes()
    (span, mine), (other_span, theirs) = state.allreduce.residual(), other.allreduce.residual()
    assert span == other_span and theirs.tobytes() == mine.tobytes()
    assert other.schedule.accumulated.tobytes() == state.schedule.accumulated.tobytes()
    assert other.schedule.density == state.schedule.density


def test_the_older_form_warns_and_writes_the_same_file(tmp_path):
    state = fresh_state(1)
    save_checkpoint(str(tmp_path / "new.h5"), state)
    with pytest.warns(DeprecationWarning, match=r"save_checkpoint\(path, state\)"):
        save_checkpoint(str(tmp_path / "old.h5"), state.group, state.config, state.step, state.layout, state.params,
                        state.velocity, state.allreduce, state.shards, local_velocity=None, schedule=state.schedule,
                        priced=None)
    new, old = contents(tmp_path / "new.h5"), contents(tmp_path / "old.h5")
    assert new.keys() == old.keys() and "residuals/rank0" in new
    assert all(new[key] == old[key] for key in new)


def test_the_state_form_takes_nothing_more(tmp_path):
    with pytest.raises(TypeError, match="nothing more"):
        save_checkpoint(str(tmp_path / "ck.h5"), fresh_state(1), 7)
