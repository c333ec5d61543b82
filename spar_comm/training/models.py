"""Built-in models: an MLP (softmax regression when it has no hidden layer),
written with Python array API operations and a hand-written backward pass,
and ``build_model``, the model a config names (here, not in the loop, so
that reading a checkpoint's parameters by name needs no MPI).

A model is anything with ``layout`` (a ParamLayout), ``init(seed)`` (the
flat parameter vector), ``loss_and_grad(params, batch) -> (loss, grad)`` with
``grad`` the flat fused gradient buffer, and ``logits(params, x)``.
"""
from __future__ import annotations

from typing import Any, Tuple

import numpy as np

from .config import TrainConfig
from .data import Dataset
from .layout import ParamLayout


class MLP:
    """``x -> [Linear -> ReLU] * depth -> Linear -> softmax cross-entropy``.

    ``depth=0`` is multinomial logistic (softmax) regression.
    """

    def __init__(self, n_in: int, n_classes: int, hidden: int, depth: int, xp: Any, dtype: str, device: Any = None):
        widths = [n_in] + [hidden] * depth + [n_classes]
        shapes = []
        for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
            shapes += [(f"layer{i}.weight", (a, b)), (f"layer{i}.bias", (b,))]
        self.layout = ParamLayout(shapes)
        self.layers = len(widths) - 1
        self.n_classes = n_classes
        self.xp, self.dtype, self.device = xp, getattr(xp, dtype), device
        self.grad = xp.zeros(self.layout.size, dtype=self.dtype, device=device)
        self._grads = self.layout.views(self.grad, xp)

    def init(self, seed: int) -> Any:
        """He-normal weights and zero biases, drawn on the host from ``seed``."""
        rng = np.random.default_rng(seed)
        flat = np.zeros(self.layout.size)
        for name, (lo, hi) in self.layout.offsets.items():
            shape = self.layout.shapes[name]
            if name.endswith("weight"):
                flat[lo:hi] = rng.standard_normal(hi - lo) * np.sqrt(2.0 / shape[0])
        return self.xp.asarray(flat, dtype=self.dtype, device=self.device)

    def logits(self, params: Any, x: Any) -> Any:
        return self._forward(self.layout.views(params, self.xp), x)[-1]

    def loss_and_grad(self, params: Any, batch: Tuple[Any, Any]) -> Tuple[float, Any]:
        """Mean cross-entropy over the batch and its gradient, in ``self.grad``."""
        xp = self.xp
        x, y = batch
        p = self.layout.views(params, xp)
        acts = self._forward(p, x)
        z = acts[-1]
        shifted = z - xp.max(z, axis=1, keepdims=True)
        e = xp.exp(shifted)
        total = xp.sum(e, axis=1, keepdims=True)
        onehot = xp.astype(y[:, None] == xp.arange(self.n_classes, device=self.device)[None, :], z.dtype)
        n = z.shape[0]
        loss = -xp.sum(onehot * (shifted - xp.log(total))) / n
        delta = (e / total - onehot) / n  # d loss / d logits
        for i in reversed(range(self.layers)):
            h = acts[i]
            self._grads[f"layer{i}.weight"][...] = h.T @ delta
            self._grads[f"layer{i}.bias"][...] = xp.sum(delta, axis=0)
            if i:
                delta = (delta @ p[f"layer{i}.weight"].T) * xp.astype(h > 0, h.dtype)
        return float(loss), self.grad

    def _forward(self, p: dict, x: Any) -> list:
        """Every layer's input, then the logits (the backward pass needs them all)."""
        acts = [x]
        for i in range(self.layers):
            z = acts[-1] @ p[f"layer{i}.weight"] + p[f"layer{i}.bias"]
            acts.append(self.xp.maximum(z, 0) if i < self.layers - 1 else z)
        return acts


def build_model(config: TrainConfig, data: Dataset, xp: Any, device: Any) -> Any:
    """The model the config names, in the array namespace ``xp``."""
    if config.model == "cnn":
        from .torch_model import small_cnn

        where = f"cuda:{device.id}" if config.device == "gpu" else "cpu"  # device: CuPy's, for gpu
        return small_cnn(config.seed, data.n_classes, config.dtype, where)
    depth = 0 if config.model == "softmax" else config.depth
    return MLP(data.n_features, data.n_classes, config.hidden, depth, xp, config.dtype, device)
