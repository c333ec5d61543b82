"""What the scripts that tests/test_torchrun.py runs under torchrun share."""
from __future__ import annotations

import sys
from typing import List

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
    """grads[rank][parameter], known to every rank: multiples of 2**-6, exact to sum, different on each rank."""
    rng = np.random.default_rng([5, step])
    return [[torch.from_numpy(rng.integers(-(2**12), 2**12, int(np.prod(s))) * 2.0**-6) for s in SHAPES]
            for _ in range(world)]


def flat(tensors) -> np.ndarray:
    """The tensors end to end, as a new array."""
    return torch.cat([t.detach().flatten() for t in tensors]).numpy()


def say(line: str) -> None:
    """One line in one write: the ranks share the launcher's stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(summary: str, failures: List[str]) -> None:
    """This rank's ``summary`` line and each failure (``rank R: ...``), then leave the group."""
    rank = dist.get_rank()
    say(f"rank {rank}: {summary}")
    for failure in failures:
        say(f"rank {rank}: FAILED {failure}")
    sct.destroy_process_group()
