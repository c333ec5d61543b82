"""A ResNet-style CNN on scikit-learn's handwritten digits, upscaled from
8x8: a real workload with convolutions and BatchNorm that needs no download.
The split is fixed (a permutation drawn with seed 0): 1440 images train,
357 are held out.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

from ..cli import positive_int

#: Images of the training split; the rest are held out.
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
