"""A ResNet-style CNN on scikit-learn's handwritten digits, upscaled from
8x8: a real workload with convolutions and BatchNorm that needs no download.
The split is ``digits``': 1440 images train, 357 are held out.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .digits import digits


# -- data: the digits, upscaled ----------------------------------------------------------------
def digits_images(size: int) -> tuple:
    """(train_x, train_y, test_x, test_y): images of size x size, one channel, in [0, 1]."""
    train_x, train_y, test_x, test_y = digits()
    train_x, test_x = (F.interpolate(x.view(-1, 1, 8, 8), size=(size, size), mode="bilinear", align_corners=False)
                       for x in (train_x, test_x))
    return train_x, train_y, test_x, test_y


# -- the model ------------------------------------------------------------------------------
class ResidualBlock(nn.Module):
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


def resnet(width: int, classes: int = 10, seed: int = 0) -> nn.Module:
    """A stem, three stages of two blocks (width, 2x, 4x channels; each later
    stage halves the image), global average pooling, a linear classifier;
    the same weights for the same ``seed``."""
    torch.manual_seed(seed)
    layers = [nn.Conv2d(1, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU()]
    cin = width
    for stage, cout in enumerate((width, 2 * width, 4 * width)):
        layers += [ResidualBlock(cin, cout, 1 if stage == 0 else 2), ResidualBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))
