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
from sklearn.datasets import load_digits
from torch import nn

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm import ALGORITHMS, retain_freed_memory
from spar_comm.cli import density, positive_float, positive_int
from spar_comm.launch import run_main

TRAIN_IMAGES = 1440


# -- data: the digits, upscaled ----------------------------------------------------------------
def digits_images(size: int) -> tuple:
    """(train_x, train_y, test_x, test_y): images of size x size, one channel, in [0, 1]."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(x / 16.0, dtype=torch.float32).view(-1, 1, 8, 8)[order]
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    y = torch.tensor(y)[order]
    return x[:TRAIN_IMAGES], y[:TRAIN_IMAGES], x[TRAIN_IMAGES:], y[TRAIN_IMAGES:]


# -- the model ------------------------------------------------------------------------------
class Residual(nn.Module):
    """ResNet's basic block: two 3x3 convolutions, and a 1x1 one on the skip
    path where the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.body(x) + self.skip(x))


def resnet(width: int, classes: int = 10) -> nn.Module:
    """A stem, three stages of two blocks (width, 2x, 4x channels; each later
    stage halves the image), global average pooling, a linear classifier."""
    layers = [nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        layers += [Residual(cin, cout, 1 if stage == 0 else 2), Residual(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def build_model(args: argparse.Namespace) -> nn.Module:
    torch.manual_seed(args.seed)
    return resnet(args.width)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's size flags (shared with bench_peers.py)."""
    parser.add_argument("--width", type=positive_int, default=64, help="channels of the first stage (default: %(default)s)")
    parser.add_argument("--image", type=positive_int, default=16, help="pixels a side (default: %(default)s)")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_cnn.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="hitopk", choices=[*ALGORITHMS, "auto"],
                        help="gradient allreduce (default: %(default)s)")
    parser.add_argument("--density", type=density, default=0.01, help="fraction of gradients sent (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=300, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="images per rank (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=0.05, help="SGD learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--eval-every", type=positive_int, default=50, help="steps (default: %(default)s)")
    add_model_arguments(parser)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    train_x, train_y, test_x, test_y = digits_images(args.image)
    generator = torch.Generator().manual_seed(args.seed * 1000 + sct.rank())       # spar_comm

    model = build_model(args)
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
