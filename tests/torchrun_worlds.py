"""Run by ``tests/test_torchrun.py`` under torchrun: every way into
spar_comm.torch, called as a user's script would, each result printed as one
line, ``rank R: NAME: OUTCOME``. ``--init`` starts torch.distributed (gloo)
first: spar_comm.torch then works over its group, unless told
``transport="mpi"``. Where the hook is made, the script goes on as a user's
would, and prints what the ranks hold after a DDP step."""
from __future__ import annotations

import argparse
import os
from typing import Callable

import torch
import torch.distributed as dist

import spar_comm.torch as sct
from spar_comm import ConfigError
from torchrun_helpers import say

RANK = int(os.environ["RANK"])



def attempt(name: str, call: Callable[[], object]) -> object:
    try:
        result = call()
    except ConfigError as error:
        say(f"rank {RANK}: {name}: ConfigError: {error}")
        return None
    say(f"rank {RANK}: {name}: ran" + (f" {result!r}" if isinstance(result, int) else ""))
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--init", action="store_true", help="torch.distributed.init_process_group('gloo') first")
    args = parser.parse_args()
    if args.init:
        dist.init_process_group("gloo")
    torch.manual_seed(RANK)  # a different model and batch on every rank, as before a broadcast
    model = torch.nn.Linear(6, 1, dtype=torch.float64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    attempt("rank", sct.rank)
    attempt("size", sct.size)
    attempt("local_device", sct.local_device)
    attempt("broadcast_parameters", lambda: sct.broadcast_parameters(model))
    attempt("broadcast_optimizer_state", lambda: sct.broadcast_optimizer_state(optimizer))
    attempt("DistributedOptimizer", lambda: sct.DistributedOptimizer(optimizer, model.named_parameters(),
                                                                      algorithm="dense", density=1.0))
    attempt("comm_hook over MPI", lambda: sct.comm_hook("dense", density=1.0, transport="mpi"))
    made = attempt("comm_hook", lambda: sct.comm_hook("dense", density=1.0))
    attempt("init_process_group", sct.init_process_group)  # last: it starts torch.distributed from torchrun's environment
    if made is not None and dist.is_initialized():
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(*made)
        ddp(torch.full((1, 6), float(RANK + 1), dtype=torch.float64)).sum().backward()
        say(f"rank {RANK}: gradient: {model.weight.grad.sum().item()!r}")
    if dist.is_initialized():
        sct.destroy_process_group()


if __name__ == "__main__":
    main()
