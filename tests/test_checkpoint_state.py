"""save_checkpoint(state, path): the run's state as one value, written by
every rank (its own part) and rank 0 (the rest and the manifest), read back
to the same bits; a save cut short leaves the previous checkpoint whole; a
checkpoint of format 2 (one file) still loads."""
from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from spar_comm.files import BadFileError, create_hdf5, seal, stamp, write_image

from spar_comm.topology import Topology
from spar_comm.training import TrainConfig, TrainState, save_checkpoint
from spar_comm.training.aids import ScheduledAllreduce
from spar_comm.training import checkpoint, parts
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


def test_a_state_comes_back_to_the_bit(tmp_path):
    path = str(tmp_path / "ck.h5")
    state = fresh_state(1)
    save_checkpoint(state, path)
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


def one_part(path) -> str:
    """The part of rank 0 of the one save that the checkpoint ``path`` keeps."""
    (token,) = os.listdir(parts.folder(str(path)))
    return parts.part_path(str(path), token, 0)


def load(path: str, seed: int = 2) -> TrainState:
    """A fresh state of other values, with the checkpoint at ``path`` loaded into it."""
    state = fresh_state(seed)
    load_checkpoint(read_saved(path, state.group, LAYOUT), path, state)
    return state


def test_a_save_cut_short_leaves_the_previous_checkpoint_whole(tmp_path, monkeypatch):
    path = str(tmp_path / "ck.h5")
    first = fresh_state(1)
    save_checkpoint(first, path)
    later = fresh_state(3)
    later.step = 9
    real = os.replace

    def killed(source, target):  # the job dies as rank 0 renames the new checkpoint file into place
        if target == path:
            raise KeyboardInterrupt
        real(source, target)

    monkeypatch.setattr(checkpoint.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(later, path)
    monkeypatch.undo()
    assert len(os.listdir(parts.folder(path))) == 2  # the cut save's part is there, and not taken
    back = load(path)
    assert back.step == 7 and back.params.tobytes() == first.params.tobytes()
    assert back.allreduce.residual()[1].tobytes() == first.allreduce.residual()[1].tobytes()
    save_checkpoint(later, path)  # the next whole save removes the older and the unfinished parts
    assert len(os.listdir(parts.folder(path))) == 1 and load(path).step == 9


def test_a_missing_or_foreign_part_is_refused_by_name(tmp_path):
    path, other = str(tmp_path / "ck.h5"), str(tmp_path / "other.h5")
    save_checkpoint(fresh_state(1), path)
    save_checkpoint(fresh_state(1), other)
    mine, theirs = one_part(path), one_part(other)
    shutil.copyfile(theirs, mine)  # the same rank and step, another save
    with pytest.raises(BadFileError, match="not the file its checkpoint names") as caught:
        load(path)
    assert mine in str(caught.value)
    os.remove(mine)
    with pytest.raises(BadFileError, match="missing: the part of rank 0") as caught:
        load(path)
    assert mine in str(caught.value)


def write_format_2(path: str, state: TrainState) -> None:
    """A checkpoint as format 2 wrote it: one file, every residual in it."""
    span, residual = state.allreduce.residual()
    with create_hdf5(path, in_memory=True) as f:
        f.attrs.update(format=2, version="0.1.0", step=state.step, world_size=1, config=state.config.to_json(),
                       created="2026-11-25T00:00:00+00:00")
        for group, flat in (("params", state.params), ("optimizer/velocity", state.velocity)):
            for name, (lo, hi) in LAYOUT.offsets.items():
                f.create_dataset(f"{group}/{name}", data=flat[lo:hi].reshape(LAYOUT.shapes[name]))
        f["optimizer"].attrs.update(kind="sgd", momentum=0.9, weight_decay=0.0)
        f.create_dataset("residuals/rank0", data=residual).attrs.update(lo=span[0], hi=span[1])
        kept = f.create_group("schedule")
        accordion = state.schedule.state_dict()
        kept.attrs.update(previous_norm=accordion["previous_norm"], density=accordion["density"])
        kept.create_dataset("accumulated", data=accordion["accumulated"])
        f.create_group("data").attrs.update(seed=3, epoch=0, batch=7, steps_per_epoch=12, batch_size=20,
                                            world_size=1)
        seal(f)
        write_image(f, path)
    stamp(path)


def test_a_checkpoint_of_format_2_still_loads(tmp_path):
    path = str(tmp_path / "old.h5")
    state = fresh_state(1)
    write_format_2(path, state)
    back = load(path)
    assert back.step == 7 and back.velocity.tobytes() == state.velocity.tobytes()
    assert back.allreduce.residual()[1].tobytes() == state.allreduce.residual()[1].tobytes()
    assert back.schedule.accumulated.tobytes() == state.schedule.accumulated.tobytes()

