"""Run by ``tests/test_torchrun.py`` under torchrun: a peer that stops
answering. Steps of DDP with spar_comm's hook (``--way hook``, and
``--way checkpoint``, which saves with ``save_checkpoint`` before step 3) or
of ``DistributedOptimizer`` (``--way optimizer``) over the gloo group; at
step 3 rank 0 hangs (a peer stuck outside any collective), and prints the
time it did. The other ranks must end by their deadline (SPAR_COMM_TIMEOUT),
naming the collective they waited in; torchrun then ends rank 0."""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

import spar_comm.torch as sct
from torchrun_helpers import say


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--way", choices=["hook", "optimizer", "checkpoint"], required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.way in ("hook", "checkpoint"):
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        ddp.register_comm_hook(*sct.comm_hook("hitopk", 0.1))
        forward = ddp
    else:
        optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(), algorithm="hitopk", density=0.1)
        forward = model
    for step in range(1000):
        if step == 3 and rank == 0:
            say(f"rank 0: hangs at {time.time():.3f}")
            time.sleep(600)
        if step == 3 and args.way == "checkpoint":
            # rank 0, which alone makes the folder, never gets here: nothing is written
            sct.save_checkpoint({"model": model.state_dict()}, os.path.join(tempfile.gettempdir(), "never"), step)
        optimizer.zero_grad()
        forward(torch.randn(8, 32)).square().sum().backward()
        optimizer.step()
    say(f"rank {rank}: finished, which it must not")


if __name__ == "__main__":
    main()
