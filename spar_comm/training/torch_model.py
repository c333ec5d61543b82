"""PyTorch autograd behind the model interface: any ``torch.nn.Module``.

The module's parameters become views of the flat parameter vector and their
``.grad`` views of the flat gradient buffer, so autograd writes straight into
the fused buffer, the allreduced gradient is written back into ``.grad``, and
the optimizer's in-place updates of the flat vector are the module's weights. torch is imported only here (an optional extra).
"""
from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

from .layout import ParamLayout


class TorchModel:
    """Wrap ``module`` (its current weights are the initial parameters)."""

    def __init__(self, module: torch.nn.Module, loss_fn: Callable = torch.nn.functional.cross_entropy):
        self.module = module
        self.loss_fn = loss_fn
        named = list(module.named_parameters())
        self.layout = ParamLayout([(name, tuple(p.shape)) for name, p in named])
        dtype, device = named[0][1].dtype, named[0][1].device
        self.params = torch.empty(self.layout.size, dtype=dtype, device=device)
        self.grad = torch.zeros_like(self.params)
        views = self.layout.views(self.params, torch)
        grads = self.layout.views(self.grad, torch)
        with torch.no_grad():
            for name, p in named:
                views[name].copy_(p)
                p.data = views[name]
                p.grad = grads[name]

    def init(self, seed: int) -> Any:
        """The flat vector the module's parameters live in (seeded at construction)."""
        return self.params

    def logits(self, params: Any, x: Any) -> Any:
        self._check(params)
        with torch.no_grad():
            return self.module(x)

    def loss_and_grad(self, params: Any, batch: Tuple[Any, Any]) -> Tuple[float, Any]:
        self._check(params)
        x, y = batch
        self.grad.zero_()  # in place: .grad stays a view of the fused buffer
        loss = self.loss_fn(self.module(x), y)
        loss.backward()
        return float(loss.detach()), self.grad

    def _check(self, params: Any) -> None:
        if params is not self.params:
            raise ValueError("TorchModel trains the flat vector that init() returned, in place")


class SmallCNN(torch.nn.Module):
    """Two 3x3 convolutions and a linear head, for 8x8 one-channel images."""

    def __init__(self, n_classes: int = 10, side: int = 8):
        super().__init__()
        self.side = side
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.head = torch.nn.Linear(32 * (side // 2) ** 2, n_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, 1, self.side, self.side)
        x = torch.relu(self.conv1(x))
        x = torch.max_pool2d(torch.relu(self.conv2(x)), 2)
        return self.head(x.flatten(1))


def small_cnn(seed: int, n_classes: int, dtype: str, device: str = "cpu") -> TorchModel:
    """The demonstration CNN on ``device``, its weights drawn from ``seed`` (on
    the CPU, so that every device starts from the same weights)."""
    torch.manual_seed(seed)
    return TorchModel(SmallCNN(n_classes).to(getattr(torch, dtype)).to(device))
