"""What bench_peers.py's modes train alike, one function a model: the model,
its batches, its loss, the optimizer its own training script uses and its
held-out metric, as a ``Workload``. Every mode's model starts from the same
weights and takes the same batches; a rank's batches come from its own
generator (``seed * 1000 + rank``), as the training scripts draw theirs."""
from __future__ import annotations

from typing import Optional

import torch

from ..workloads import gpt as gpt_model
from ..workloads.mlp import mlp
from ..workloads.resnet import digits_images, resnet
from .peers import Workload, classify, held_out

#: The GPT's validation set: the same evenly spaced windows for every mode.
GPT_EVAL_BATCHES, GPT_EVAL_SEQUENCES = 16, 8


def generator_of(seed: int, rank: int) -> torch.Generator:
    """The rank's own generator of batches."""
    return torch.Generator().manual_seed(seed * 1000 + rank)


def mlp_workload(inputs: int, hidden: int, layers: int, batch_size: int, lr: Optional[float], seed: int,
                 rank: int) -> Workload:
    """``mlp(inputs, hidden, layers)`` on one batch of random data, drawn once
    (nothing held out), with SGD (``lr`` 1e-3 by default)."""
    generator = generator_of(seed, rank)
    x = torch.randn(batch_size, inputs, generator=generator)
    y = torch.randint(10, (batch_size,), generator=generator)
    return Workload(lambda: mlp(inputs, hidden, layers), lambda: (x, y), classify,
                    lambda params: torch.optim.SGD(params, lr=lr or 1e-3))


def gpt_workload(config: gpt_model.GPTConfig, batch_size: int, lr: Optional[float], seed: int,
                 rank: int) -> Workload:
    """train_gpt.py's GPT on the standard library's sources with AdamW (``lr``
    1e-3 by default); its metric the loss on the same validation windows for
    every mode."""
    generator = generator_of(seed, rank)
    text, validation = gpt_model.stdlib_text()
    batches = gpt_model.validation_batches(validation, GPT_EVAL_BATCHES, GPT_EVAL_SEQUENCES, config.context)
    return Workload(lambda: gpt_model.gpt(config, seed),
                    lambda: gpt_model.random_batch(text, batch_size, config.context, generator),
                    lambda model, batch: model(*batch),
                    lambda params: torch.optim.AdamW(params, lr=lr or 1e-3, weight_decay=0.01),
                    held_out(lambda m: sum(m(x, y).item() for x, y in batches) / len(batches)),
                    "validation loss", lower_is_better=True)


def cnn_workload(width: int, image: int, batch_size: int, lr: Optional[float], seed: int, rank: int) -> Workload:
    """train_cnn.py's ResNet on the digits at ``image`` pixels a side with SGD
    and momentum (``lr`` 0.05 by default); its metric the held-out accuracy."""
    generator = generator_of(seed, rank)
    x, y, test_x, test_y = digits_images(image)

    def batch():
        picked = torch.randint(len(y), (batch_size,), generator=generator)
        return x[picked], y[picked]

    return Workload(lambda: resnet(width, seed=seed), batch, classify,
                    lambda params: torch.optim.SGD(params, lr=lr or 0.05, momentum=0.9, weight_decay=5e-4),
                    held_out(lambda m: (m(test_x).argmax(1) == test_y).float().mean().item()),
                    "held-out accuracy")
