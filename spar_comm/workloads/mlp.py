"""An MLP of ReLU layers ending in 10 classes: a model whose size is set by
three numbers, for timing steps where the data does not matter."""
from __future__ import annotations

import torch


def mlp(inputs: int, hidden: int, layers: int, seed: int = 0) -> torch.nn.Module:
    """``inputs`` -> ``hidden``, then ``layers`` hidden-to-hidden layers, then
    10 outputs, each but the last followed by ReLU; the same weights for the
    same ``seed``."""
    torch.manual_seed(seed)
    widths = [inputs] + [hidden] * (layers + 1)
    modules = []
    for a, b in zip(widths[:-1], widths[1:]):
        modules += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*modules, torch.nn.Linear(hidden, 10))
