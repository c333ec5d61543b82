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

import torch

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm import ALGORITHMS, retain_freed_memory
from spar_comm.cli import density, positive_float, positive_int
from spar_comm.launch import run_main
from spar_comm.workloads.gpt import (add_model_arguments, build_model, random_batch, settle_model_arguments,
                                     stdlib_text, validation_batches)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_gpt.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="hitopk", choices=[*ALGORITHMS, "auto"],
                        help="gradient allreduce (default: %(default)s)")
    parser.add_argument("--density", type=density, default=0.01, help="fraction of gradients sent (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=300, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--eval-every", type=positive_int, default=50, help="steps (default: %(default)s)")
    parser.add_argument("--eval-batches", type=positive_int, default=8, help="(default: %(default)s)")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    settle_model_arguments(parser, args)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    train, validation = stdlib_text()
    held_out = validation_batches(validation, args.eval_batches, args.batch_size, args.context)
    generator = torch.Generator().manual_seed(args.seed * 1000 + sct.rank())       # spar_comm

    model = build_model(args)
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
