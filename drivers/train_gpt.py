#!/usr/bin/env python
"""A small GPT (a decoder-only Transformer, about 11M parameters by default)
trained on the Python standard library's own sources, bytes as tokens. A
plain PyTorch script made data-parallel by spar_comm: the lines marked
``# spar_comm`` are the whole change.

    mpiexec -n 4 python drivers/train_gpt.py
    mpiexec -n 2 python drivers/train_gpt.py --tiny --steps 20 --algorithm dense

The text is the top-level ``*.py`` files of the standard library of the
Python that runs the script, in name order; every tenth file is held out for
validation. Emulated nodes: SPAR_COMM_RANKS_PER_NODE=2.
"""
import argparse
from typing import Tuple

import torch

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm import retain_freed_memory
from spar_comm.cli import positive_int
from spar_comm.launch import run_main
from spar_comm.workloads.command_line import add_gpt_arguments, add_training_arguments, gpt_config
from spar_comm.workloads.gpt import GPTConfig, gpt, random_batch, stdlib_text, validation_batches


def parse_args(argv=None) -> Tuple[argparse.Namespace, GPTConfig]:
    parser = argparse.ArgumentParser(prog="train_gpt.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(parser, batch_size=8, batch_of="sequences", optimizer="AdamW", lr=1e-3)
    parser.add_argument("--eval-batches", type=positive_int, default=8, help="(default: %(default)s)")
    add_gpt_arguments(parser)
    args = parser.parse_args(argv)
    return args, gpt_config(parser, args)


def main() -> None:
    args, config = parse_args()
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    train, validation = stdlib_text()
    held_out = validation_batches(validation, args.eval_batches, args.batch_size, args.context)
    generator = torch.Generator().manual_seed(args.seed * 1000 + sct.rank())       # spar_comm

    model = gpt(config, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sct.broadcast_parameters(model)                                                  # spar_comm
    optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(),        # spar_comm
                                         algorithm=args.algorithm, density=args.density)
    if sct.rank() == 0:                                                              # spar_comm
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train):,} training bytes, "
              f"{len(validation):,} validation bytes", flush=True)

    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        loss = model(*random_batch(train, args.batch_size, args.context, generator))
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                val = sum(model(x, y).item() for x, y in held_out) / len(held_out)
            model.train()
            if sct.rank() == 0:                                                      # spar_comm
                print(f"step {step:5d}  train loss {loss.item():.4f}  validation loss {val:.4f}", flush=True)


if __name__ == "__main__":
    run_main(main, "train_gpt.py")
