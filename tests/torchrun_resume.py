"""Run by ``tests/test_torchrun.py`` under torchrun, twice: ``save DIR`` on
one world, then ``load DIR`` on another. The optimizer's and the DDP hook's
state cross worlds through ``spar_comm.torch.save_checkpoint`` /
``load_checkpoint``.

``save``: three steps of each (the optimizer on nodes of one rank, so that
every rank's residual covers its whole bucket and the ranks' residuals
overlap; the hook on one node, each rank a shard), then a save, and beside
it each rank's residuals and parameters as NumPy files, read straight from
the allreducers: the reference, which owes nothing to DCP.

``load``: the checkpoint through ``load_checkpoint`` into fresh objects (the
optimizer on one node when the world grew, so that the spans become shards;
on nodes of one rank when it shrank, so that they overlap again); checked
against the NumPy files: the parameters to the bit; the
new ranks' residuals, summed, equal the saved ranks' summed in rank order
(one sum's rounding: each position's total sits on one new rank); no
position on two new ranks; a step of each then runs. A plain ``dcp.load``
into templates of this world is refused by spar_comm, naming
``load_checkpoint``, on every rank alike (on more ranks than saved, with
``allow_partial_load``; without it DCP stops first, which is checked too).
Prints ``rank R: FAILURES failed`` and each failure."""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

import spar_comm.torch as sct
from spar_comm import ConfigError, Topology
from spar_comm.torch.transport import TorchComm
from torchrun_helpers import Chosen, flat, grads_of, report

CAP_MB = 48 * 8 / 2**20  # about 48 float64 values a bucket: several buckets
STEPS = 3


def build(ranks_per_node=None):
    """(optimizer's model, optimizer, hook's model, DDP model, hook state), fresh."""
    opt_model = Chosen()
    topology = Topology(TorchComm.world(), ranks_per_node=ranks_per_node) if ranks_per_node else None
    opt = sct.DistributedOptimizer(torch.optim.SGD(opt_model.parameters(), lr=0.25, momentum=0.9),
                                   opt_model.named_parameters(), algorithm="hitopk", density=0.1,
                                   bucket_cap_mb=CAP_MB, topology=topology)
    hook_model = Chosen()
    ddp = torch.nn.parallel.DistributedDataParallel(hook_model, bucket_cap_mb=CAP_MB)
    hook, function = sct.comm_hook("hitopk", 0.1)
    ddp.register_comm_hook(hook, function)
    return opt_model, opt, hook_model, ddp, hook


def train(parts, rank: int, world: int, steps) -> None:
    opt_model, opt, hook_model, ddp, _ = parts
    hook_opt = torch.optim.SGD(ddp.parameters(), lr=0.25)
    for step in steps:
        opt.zero_grad()
        opt_model(grads_of(step, world)[rank]).backward()
        opt.step()
        hook_opt.zero_grad()
        ddp(grads_of(step, world)[rank]).backward()
        hook_opt.step()


def state_of(parts) -> dict:
    opt_model, opt, hook_model, _, hook = parts
    return {"opt_model": opt_model, "optimizer": opt, "hook_model": hook_model, "hook": hook}


def optimizer_residuals(opt) -> dict:
    """Each bucket's residual over the whole bucket, zeros outside this rank's span."""
    return {f"bucket{i}": b.reducer.memory.to_host(b.reducer.residual_full()) for i, b in enumerate(opt.buckets)}


def hook_residuals(hook) -> dict:
    return {f"{b}_{p}": values for (b, p), values in hook.residuals().items()}


def save(directory: str, rank: int, world: int, failures: list) -> None:
    parts = build(ranks_per_node=1)
    train(parts, rank, world, range(STEPS))
    opt_model, opt, hook_model, _, hook = parts
    sct.save_checkpoint(state_of(parts), directory, STEPS)
    reference = os.path.join(directory, "..", "reference")
    os.makedirs(reference, exist_ok=True)
    np.savez(os.path.join(reference, f"optimizer.rank{rank}.npz"), **optimizer_residuals(opt))
    np.savez(os.path.join(reference, f"hook.rank{rank}.npz"), **hook_residuals(hook))
    np.savez(os.path.join(reference, f"params.rank{rank}.npz"), opt=flat(opt_model.ps), hook=flat(hook_model.ps))
    if not any(v.any() for v in optimizer_residuals(opt).values()) or not any(
            v.any() for v in hook_residuals(hook).values()):
        failures.append("save: no residual to carry: the test shows nothing")


def saved_total(directory: str, kind: str) -> dict:
    """The saved ranks' residuals summed in rank order, from the NumPy files."""
    reference = os.path.join(directory, "..", "reference")
    files = sorted((f for f in os.listdir(reference) if f.startswith(f"{kind}.rank")),
                   key=lambda f: int(f.split("rank")[1].split(".")[0]))
    total: dict = {}
    for name in files:
        with np.load(os.path.join(reference, name)) as saved:
            for key in saved.files:
                total[key] = total[key] + saved[key] if key in total else saved[key].copy()
    return total, len(files)


def compare_totals(mine: dict, expected: dict, what: str, failures: list) -> None:
    """The new ranks' residuals summed against ``expected``, and each position on one new rank at most."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    keys = set(expected)
    for theirs in everyone:
        keys |= set(theirs)
    for key in sorted(keys):
        arrays = [theirs[key] for theirs in everyone if key in theirs]
        total = sum(arrays[1:], arrays[0].copy()) if arrays else None
        if key not in expected or total is None or not np.array_equal(total, expected[key]):
            failures.append(f"{what}: the residuals' total at {key} is not the saved ranks' total")
        elif (np.stack([a != 0 for a in arrays]).sum(axis=0) > 1).any():
            failures.append(f"{what}: a position of {key} is on two new ranks")


def plain_loads(directory: str, saved_world: int, world: int, failures: list) -> None:
    """A plain dcp.load into this world's templates, then the objects' own load_state_dict."""
    checkpoint = sct.checkpoint.committed(directory)[0]
    for planner in (None, DefaultLoadPlanner(allow_partial_load=True)):
        parts = build()
        parts[1].init_state()
        template = {key: value.state_dict() for key, value in state_of(parts).items()}
        try:
            dcp.load(template, checkpoint_id=checkpoint, planner=planner)
        except BaseException as error:  # noqa: BLE001 (DCP's CheckpointException is a BaseException)
            if planner is None and world > saved_world and "Missing key" in str(error):
                continue  # DCP's own refusal: a rank's template names a key the smaller world never saved
            failures.append(f"plain dcp.load (planner {planner}): {type(error).__name__}: {str(error)[:200]}")
            continue
        for key in ("optimizer", "hook"):
            try:
                state_of(parts)[key].load_state_dict(template[key])
                failures.append(f"plain dcp.load (planner {planner}): the {key}'s state of {saved_world} ranks loaded")
            except ConfigError as error:
                if "spar_comm.torch.load_checkpoint" not in str(error):
                    failures.append(f"plain dcp.load (planner {planner}): the {key} says {error}")
        touched = [key for key, values in optimizer_residuals(parts[1]).items() if values.any()]
        if touched or parts[4].residuals():
            failures.append(f"plain dcp.load (planner {planner}): a refused load left residuals {touched}")


def load(directory: str, rank: int, world: int, failures: list) -> None:
    _, saved_world = saved_total(directory, "params")
    parts = build(ranks_per_node=1 if world < saved_world else None)
    resumed = sct.load_checkpoint(state_of(parts), directory)
    opt_model, opt, hook_model, _, hook = parts
    if resumed is None or (resumed.step, resumed.saved_world, resumed.world) != (STEPS, saved_world, world):
        failures.append(f"load_checkpoint returned {resumed}")
    with np.load(os.path.join(directory, "..", "reference", "params.rank0.npz")) as params:
        if not (np.array_equal(flat(opt_model.ps), params["opt"]) and np.array_equal(flat(hook_model.ps),
                                                                                       params["hook"])):
            failures.append("the parameters did not come back to the bit")
    compare_totals(optimizer_residuals(opt), saved_total(directory, "optimizer")[0], "optimizer", failures)
    compare_totals(hook_residuals(hook), saved_total(directory, "hook")[0], "hook", failures)
    if not opt.state:
        failures.append("the wrapped optimizer's momentum was not loaded")
    train(parts, rank, world, range(STEPS, STEPS + 1))
    if not np.isfinite(flat(opt_model.ps)).all() or not np.isfinite(flat(hook_model.ps)).all():
        failures.append("a step after the resume gave non-finite parameters")
    if world != saved_world:
        plain_loads(directory, saved_world, world, failures)


def main() -> None:
    mode, directory = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    failures: list = []
    (save if mode == "save" else load)(directory, rank, world, failures)
    report(f"{len(failures)} failed", failures)


if __name__ == "__main__":
    main()
