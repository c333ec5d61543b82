#!/usr/bin/env python
"""A ResNet-style CNN (about 2.8M parameters by default) on scikit-learn's
handwritten digits, upscaled from 8x8 to 16x16 pixels. A plain PyTorch
script made data-parallel by spar_comm: the lines marked ``# spar_comm`` are
the whole change.

    mpiexec -n 4 python drivers/train_cnn.py
    mpiexec -n 2 python drivers/train_cnn.py --width 8 --steps 30 --algorithm dense

The split is fixed (a permutation drawn with seed 0): 1440 images train,
357 are held out. Emulated nodes: SPAR_COMM_RANKS_PER_NODE=2.
"""
import argparse

import torch
import torch.nn.functional as F

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm import retain_freed_memory
from spar_comm.launch import run_main
from spar_comm.workloads.command_line import add_resnet_arguments, add_training_arguments
from spar_comm.workloads.resnet import digits_images, resnet


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_cnn.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_training_arguments(parser, batch_size=32, batch_of="images", optimizer="SGD", lr=0.05)
    add_resnet_arguments(parser)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    train_x, train_y, test_x, test_y = digits_images(args.image)
    generator = torch.Generator().manual_seed(args.seed * 1000 + sct.rank())       # spar_comm

    model = resnet(args.width, seed=args.seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=5e-4)
    sct.broadcast_parameters(model)                                                  # spar_comm
    optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(),        # spar_comm
                                         algorithm=args.algorithm, density=args.density)
    if sct.rank() == 0:                                                              # spar_comm
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train_y)} training images, "
              f"{len(test_y)} held out", flush=True)

    for step in range(1, args.steps + 1):
        picked = torch.randint(len(train_y), (args.batch_size,), generator=generator)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(train_x[picked]), train_y[picked])
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()  # rank 0's BatchNorm statistics: they are each rank's own
            with torch.no_grad():
                accuracy = (model(test_x).argmax(1) == test_y).float().mean().item()
            model.train()
            if sct.rank() == 0:                                                      # spar_comm
                print(f"step {step:5d}  train loss {loss.item():.4f}  held-out accuracy {accuracy:.4f}", flush=True)


if __name__ == "__main__":
    run_main(main, "train_cnn.py")
