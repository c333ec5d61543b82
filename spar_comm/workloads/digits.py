"""scikit-learn's handwritten digits, split the same way on every rank: the
small real data set that the example scripts and the ResNet train on, with
nothing to download."""
from __future__ import annotations

from typing import Tuple

import torch
from sklearn.datasets import load_digits

#: Images of the training split; the rest (357) are held out.
TRAIN_IMAGES = 1440


def digits(device: torch.device | str = "cpu") -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y) on ``device``: rows of 64 pixels in
    [0, 1] and their classes, in a fixed order (a permutation drawn with seed
    0), so that every rank holds out the same images."""
    x, y = load_digits(return_X_y=True)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x / 16.0, dtype=torch.float32)[order].to(device), torch.tensor(y)[order].to(device)
    return x[:TRAIN_IMAGES], y[:TRAIN_IMAGES], x[TRAIN_IMAGES:], y[TRAIN_IMAGES:]
