"""Run by ``tests/test_torchrun.py`` under torchrun: DDP with spar_comm's
hook over the gloo group, no MPI launch. ``dense``: every rank's gradient is
the exact mean. ``hitopk``: the same bits on every rank each step, and
conservation (what was applied, times the ranks, plus every rank's residual
is the sum of the raw gradients: exactly, the gradients being multiples of
2**-6, where the ranks are a power of two; else to the mean's rounding). Then a NaN on the last rank: a NaN bucket on every rank and the
residuals as they were; then the state through state_dict/load_state_dict;
then GradScaler's recipe with an overflow on one rank, skipped alike everywhere.
Prints ``rank R: FAILURES failed`` and each failure."""
from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist

import spar_comm.torch as sct
from torchrun_helpers import Chosen, flat, grads_of, report

def run(algorithm: str, rank: int, world: int, failures: list) -> None:
    model = Chosen()
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=48 * 8 / 2**20)
    state, hook = sct.comm_hook(algorithm, 0.1)
    ddp.register_comm_hook(state, hook)
    applied, raw = 0, 0
    for step in range(3):
        grads = grads_of(step, world)
        ddp.zero_grad()
        ddp(grads[rank]).backward()
        got = flat(p.grad for p in model.ps)
        applied, raw = applied + got, raw + sum(flat(g) for g in grads)
        digests = [None] * world
        dist.all_gather_object(digests, hashlib.sha256(got.tobytes()).hexdigest())
        if len(set(digests)) > 1:
            failures.append(f"{algorithm} step {step}: ranks hold different gradients")
        if algorithm == "dense" and not np.array_equal(got, sum(flat(g) for g in grads) / world):
            failures.append(f"dense step {step}: not the mean")
    mine = state.residuals()
    local = np.concatenate([mine.get(state._coordinates[id(p)], np.zeros(p.numel())) for p in model.ps])
    kept = torch.from_numpy(local.copy())
    dist.all_reduce(kept)
    exact = world & (world - 1) == 0  # dividing by a power of two rounds nothing
    total = applied * world + kept.numpy()
    if not (np.array_equal(total, raw) if exact else np.allclose(total, raw, rtol=0, atol=1e-9)):
        failures.append(f"{algorithm}: applied + residuals is not the sum of the raw gradients")
    if algorithm == "dense":
        return
    poisoned = grads_of(3, world)[rank]
    if rank == world - 1:
        poisoned[1][3] = float("nan")
    ddp.zero_grad()
    ddp(poisoned).backward()
    if not torch.isnan(model.ps[1].grad).all():
        failures.append("the bucket of a NaN on one rank is not NaN on every rank")
    at = state._coordinates[id(model.ps[1])]
    if not np.array_equal(state.residuals()[at], mine[at]):
        failures.append("a NaN bucket changed its residual")
    saved = state.state_dict()
    fresh, _ = sct.comm_hook(algorithm, 0.1)
    fresh.load_state_dict(saved)
    back, kept = fresh._loaded, state.residuals()
    if back.keys() != kept.keys() or not all(np.array_equal(back[c], v) for c, v in kept.items()):
        failures.append("the state does not come back through state_dict/load_state_dict")


def amp(rank: int, world: int, failures: list) -> None:
    """GradScaler's plain recipe over the group: an overflow on the last rank
    at step 1 is skipped on every rank, the scale halved alike, the weights
    and the residuals left as they were."""
    model = Chosen()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=48 * 8 / 2**20)
    state, hook = sct.comm_hook("hitopk", 0.1, grad_scaler=scaler)
    ddp.register_comm_hook(state, hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.5)
    for step in range(3):
        grads = grads_of(10 + step, world)[rank]
        if step == 1 and rank == world - 1:
            grads[2][3] = float("inf")
        before = flat(model.ps).copy(), state.residuals(), scaler.get_scale()
        optimizer.zero_grad()
        scaler.scale(ddp(grads)).backward()
        scaler.step(optimizer)
        scaler.update()
        if step != 1:
            continue
        after = state.residuals()
        if scaler.get_scale() != before[2] / 2:
            failures.append(f"amp: the scale went from {before[2]} to {scaler.get_scale()}")
        if not np.array_equal(flat(model.ps), before[0]):
            failures.append("amp: the skipped step moved the weights")
        if after.keys() != before[1].keys() or not all(np.array_equal(after[c], v) for c, v in before[1].items()):
            failures.append("amp: the skipped step changed a residual")
    digests = [None] * world
    dist.all_gather_object(digests, hashlib.sha256(flat(model.ps).tobytes()).hexdigest())
    if len(set(digests)) > 1:
        failures.append("amp: the replicas differ")



def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failures: list = []
    for algorithm in ("dense", "hitopk"):
        run(algorithm, rank, world, failures)
    amp(rank, world, failures)
    report(f"{len(failures)} failed", failures)


if __name__ == "__main__":
    main()
