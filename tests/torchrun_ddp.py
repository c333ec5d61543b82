"""Run by ``tests/test_torchrun.py`` under torchrun: DDP with spar_comm's
hook over the gloo group, no MPI launch. ``dense``: every rank's gradient is
the exact mean. ``hitopk``: the same bits on every rank each step, and
conservation (what was applied, times the ranks, plus every rank's residual
is the sum of the raw gradients: exactly, the gradients being multiples of
2**-6, where the ranks are a power of two; else to the mean's rounding). Then a NaN on the last rank: a NaN bucket on every rank and the
residuals as they were; then the state through state_dict/load_state_dict.
Prints ``rank R: FAILURES failed`` and each failure."""
from __future__ import annotations

import hashlib
import sys

import numpy as np
import torch
import torch.distributed as dist

import spar_comm.torch as sct

SHAPES = [(7, 5), (40,), (30,), (4, 4), (11,)]


class Chosen(torch.nn.Module):
    """loss = sum(p * g): the gradient of each parameter is the g handed in."""

    def __init__(self):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES])

    def forward(self, grads):
        return sum((p * g.reshape(p.shape)).sum() for p, g in zip(self.ps, grads))


def grads_of(step: int, world: int) -> list:
    """grads[rank][parameter], known to every rank: multiples of 2**-6, exact to sum."""
    rng = np.random.default_rng([5, step])
    return [[torch.from_numpy(rng.integers(-(2**12), 2**12, int(np.prod(s))) * 2.0**-6) for s in SHAPES]
            for _ in range(world)]


def flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().flatten() for t in tensors]).numpy()


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


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    failures: list = []
    for algorithm in ("dense", "hitopk"):
        run(algorithm, rank, world, failures)
    say(f"rank {rank}: {len(failures)} failed")
    for failure in failures:
        say(f"rank {rank}: FAILED {failure}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
