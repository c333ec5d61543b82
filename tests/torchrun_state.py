"""Run by ``tests/test_torchrun.py`` under torchrun: the optimizer's and the
DDP hook's state through ``torch.distributed.checkpoint`` over the gloo group.

Each rank's gradients differ, so each rank's residuals differ: a checkpoint
that kept one rank's copy of a key for every rank (DCP's deduplication of a
key saved with different values) would give some rank another's. Checked:
each rank's ``state_dict()`` holds its own residuals only; in the checkpoint
every rank's residuals sit under their own keys, in that rank's own file;
they come back to the bit on their rank, and differ between ranks; a run
resumed from the checkpoint reaches the bits of the run that never stopped
(the optimizer; the hook: applied gradients plus residuals conserve the raw
gradients); and a template taken from a fresh optimizer without
``init_state()`` is refused on every rank rather than losing the momentum.
The same for the outer loop (``OuterLoop``), saved between two outer
steps. Each save goes to a new directory. Prints ``rank R: FAILURES failed`` and
each failure."""
from __future__ import annotations

import hashlib
import shutil
import tempfile

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import spar_comm.torch as sct
from spar_comm import ConfigError
from torchrun_helpers import Chosen, flat, grads_of, report

CAP_MB = 48 * 8 / 2**20  # about 48 float64 values a bucket: several buckets


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes() for a in arrays)).hexdigest()


def everyone(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def new_directory() -> str:
    """A directory no checkpoint was saved in, the same on every rank."""
    made = [tempfile.mkdtemp(prefix="spar_comm_dcp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    return made[0]


def stored_where(directory: str, prefix: str) -> dict:
    """{key: the file holding it} for the checkpoint's keys under ``prefix``."""
    metadata = FileSystemReader(directory).read_metadata()
    return {index.fqn: info.relative_path for index, info in metadata.storage_data.items()
            if index.fqn.startswith(prefix)}


def check_layout(directory: str, prefix: str, what: str, failures: list) -> None:
    """Every rank's residuals under keys naming the rank, in that rank's file."""
    world = dist.get_world_size()
    where = stored_where(directory, prefix)
    for r in range(world):
        mine = {key: path for key, path in where.items() if key.startswith(f"{prefix}rank{r}")}
        if not mine:
            failures.append(f"{what}: no key of rank {r} in the checkpoint")
        elif set(mine.values()) != {f"__{r}_0.distcp"}:
            failures.append(f"{what}: rank {r}'s residuals are stored in {sorted(set(mine.values()))}")
    if any(not key.startswith(tuple(f"{prefix}rank{r}" for r in range(world))) for key in where):
        failures.append(f"{what}: residual keys that name no rank: {sorted(where)}")


def optimizer_run(seed: int = 0):
    model = Chosen()
    with torch.no_grad():
        for i, p in enumerate(model.ps):
            p.fill_(seed + i)
    opt = sct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.9),
                                   model.named_parameters(), algorithm="hitopk", density=0.1, bucket_cap_mb=CAP_MB)
    return model, opt


def train(model, opt, rank: int, world: int, steps) -> None:
    for step in steps:
        opt.zero_grad()
        model(grads_of(step, world)[rank]).backward()
        opt.step()


def residuals_of(opt) -> list:
    return [bucket.reducer.residual_state()[1].copy() for bucket in opt.buckets]


def optimizer_state(rank: int, world: int, failures: list) -> None:
    straight = optimizer_run()
    train(*straight, rank, world, range(6))

    model, opt = optimizer_run()
    train(model, opt, rank, world, range(3))
    saved_residuals = residuals_of(opt)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()}
    if list(state["optimizer"]["spar_comm"]["residuals"]) != [f"rank{rank}"]:
        failures.append(f"optimizer: state_dict() holds {list(state['optimizer']['spar_comm']['residuals'])}")
    if not any(r.any() for r in saved_residuals):
        failures.append("optimizer: no residual to save: the test shows nothing")
    if len(set(everyone(digest(saved_residuals)))) != world:
        failures.append("optimizer: the ranks' residuals do not differ: the test shows nothing")
    directory = new_directory()
    try:
        dcp.save(state, checkpoint_id=directory)
        check_layout(directory, "optimizer.spar_comm.residuals.", "optimizer", failures)

        # a template taken from a fresh optimizer that has no momentum yet: refused, not half loaded
        model, opt = optimizer_run(seed=5)
        template = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(template, checkpoint_id=directory)
        try:
            opt.load_state_dict(template["optimizer"])
            failures.append("optimizer: a template without the momentum loaded")
        except ConfigError as error:
            if "init_state()" not in str(error):
                failures.append(f"optimizer: the refusal of a template without momentum says {error}")
        if any(r.any() for r in residuals_of(opt)):
            failures.append("optimizer: a refused load changed a residual")

        model, opt = optimizer_run(seed=5)
        opt.init_state()
        if any(float(p.detach().sum()) != 5 * p.numel() + i * p.numel() for i, p in enumerate(model.ps)):
            failures.append("optimizer: init_state() moved a parameter")
        template = {"model": model.state_dict(), "optimizer": opt.state_dict()}
        dcp.load(template, checkpoint_id=directory)
        model.load_state_dict(template["model"])
        opt.load_state_dict(template["optimizer"])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
    back = residuals_of(opt)
    if len(back) != len(saved_residuals) or not all(np.array_equal(a, b) for a, b in zip(back, saved_residuals)):
        failures.append("optimizer: this rank's residuals did not come back to the bit")
    train(model, opt, rank, world, range(3, 6))
    if not np.array_equal(flat(model.ps), flat(straight[0].ps)):
        failures.append("optimizer: the run resumed from the checkpoint differs from the one that never stopped")


def hook_run(rank: int, world: int, steps, state_dict=None):
    model = Chosen()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=CAP_MB)
    state, hook = sct.comm_hook("hitopk", 0.1)
    ddp.register_comm_hook(state, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.25)
    if state_dict is not None:
        model.load_state_dict(state_dict["model"])
        state.load_state_dict(state_dict["hook"])
    applied = 0
    for step in steps:
        opt.zero_grad()
        ddp(grads_of(step, world)[rank]).backward()
        applied = applied + flat(p.grad for p in model.ps) * world
        opt.step()
    return model, state, applied


def residual_sum(state, model) -> np.ndarray:
    """Every rank's residual summed, in parameter order."""
    mine = state.residuals()
    local = np.concatenate([mine.get(state._coordinates[id(p)], np.zeros(p.numel())) for p in model.ps])
    total = torch.from_numpy(local.copy())
    dist.all_reduce(total)
    return total.numpy()


def hook_state(rank: int, world: int, failures: list) -> None:
    model, state, before = hook_run(rank, world, range(3))
    kept = state.residuals()
    saved = {"model": model.state_dict(), "hook": state.state_dict()}
    if list(saved["hook"]["residuals"]) != [f"rank{rank}"]:
        failures.append(f"hook: state_dict() holds {list(saved['hook']['residuals'])}")
    if not any(v.any() for v in kept.values()):
        failures.append("hook: no residual to save: the test shows nothing")
    if len(set(everyone(digest(kept[c] for c in sorted(kept))))) != world:
        failures.append("hook: the ranks' residuals do not differ: the test shows nothing")
    directory = new_directory()
    try:
        dcp.save(saved, checkpoint_id=directory)
        check_layout(directory, "hook.residuals.", "hook", failures)
        fresh, _ = sct.comm_hook("hitopk", 0.1)  # knows no parameter yet: its state_dict() is the template
        template = {"model": Chosen().state_dict(), "hook": fresh.state_dict()}
        dcp.load(template, checkpoint_id=directory)
        fresh.load_state_dict(template["hook"])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
    back = fresh._loaded
    if back.keys() != kept.keys() or not all(np.array_equal(back[c], v) and back[c].dtype == v.dtype
                                             for c, v in kept.items()):
        failures.append("hook: this rank's residuals did not come back to the bit")
    model, state, after = hook_run(rank, world, range(3, 5), template)
    raw = sum(flat(g) for step in range(5) for g in grads_of(step, world))
    total = before + after + residual_sum(state, model)
    exact = world & (world - 1) == 0  # dividing by a power of two rounds nothing
    if not (np.array_equal(total, raw) if exact else np.allclose(total, raw, rtol=0, atol=1e-9)):
        failures.append("hook: the resumed run lost residual: applied + residuals is not the raw gradients' sum")


def outer_run(seed: int = 0):
    """The outer loop around an SGD with momentum: hitopk every 2 steps, an outer momentum."""
    model = Chosen()
    with torch.no_grad():
        for i, p in enumerate(model.ps):
            p.fill_(seed + i)
    inner = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.9)
    outer = sct.OuterLoop(model.named_parameters(), every=2, algorithm="hitopk", density=0.1, lr=0.8, momentum=0.5,
                          bucket_cap_mb=CAP_MB)
    return model, inner, outer


def local_steps(model, inner, outer, rank: int, world: int, steps) -> None:
    for step in steps:
        inner.zero_grad()
        model(grads_of(step, world)[rank]).backward()
        inner.step()
        outer.step()


def outer_state(rank: int, world: int, failures: list) -> None:
    """OuterLoop over the gloo group: the same bits on every rank after an
    outer step; saved between two outer steps with sct.save_checkpoint, each
    rank's residuals and weights under its own keys, and resumed on a fresh
    loop to the bits of the run that never stopped."""
    straight = outer_run()
    local_steps(*straight, rank, world, range(6))
    if len(set(everyone(digest([p.detach().numpy() for p in straight[0].ps])))) != 1:
        failures.append("outer loop: the ranks' weights differ after an outer step")
    model, inner, outer = outer_run()
    local_steps(model, inner, outer, rank, world, range(3))  # one step past the outer step at 2
    if len(set(everyone(digest([p.detach().numpy() for p in model.ps])))) != world:
        failures.append("outer loop: the ranks' weights between outer steps do not differ: the test shows nothing")
    directory = new_directory()
    try:
        # The outer loop's state holds the weights, each rank's own between outer
        # steps: no "model" entry, which DCP would keep once for every rank. So
        # is the inner optimizer's state each rank's own: under a key of its
        # rank, through DCP's helpers, which give a fresh optimizer its momentum to fill.
        key = f"inner.rank{rank}"
        sct.save_checkpoint({key: get_optimizer_state_dict(model, inner), "outer": outer}, directory, 3)
        model, inner, outer = outer_run(seed=5)
        state = {key: get_optimizer_state_dict(model, inner), "outer": outer}
        sct.load_checkpoint(state, directory)
        set_optimizer_state_dict(model, inner, state[key])
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(directory)
    local_steps(model, inner, outer, rank, world, range(3, 6))
    if not np.array_equal(flat(model.ps), flat(straight[0].ps)):
        failures.append("outer loop: the run resumed from the checkpoint differs from the one that never stopped")


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    failures: list = []
    optimizer_state(rank, world, failures)
    hook_state(rank, world, failures)
    outer_state(rank, world, failures)
    report(f"{len(failures)} failed", failures)


if __name__ == "__main__":
    main()
