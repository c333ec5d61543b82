"""A small GPT (a decoder-only Transformer) trained on the Python standard
library's own sources, bytes as tokens: a real workload with attention,
layer norms and embeddings, whose text every Python installation has.
The text is the top-level ``*.py`` files of the standard library of the
running Python, in name order; every tenth file is held out for validation.
"""
from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class GPTConfig:
    """The model's size: Transformer blocks, embedding width, attention heads
    (a divisor of the width) and bytes per sequence."""

    layers: int = 6
    width: int = 384
    heads: int = 6
    context: int = 128


#: A model and context small enough for a smoke test.
TINY = GPTConfig(layers=2, width=32, heads=2, context=32)


# -- data: the standard library's sources, one byte a token ------------------------------------
def stdlib_text() -> tuple:
    """(train, validation) as uint8 tensors: every tenth file (in name order) validates."""
    root = sysconfig.get_paths()["stdlib"]
    names = sorted(name for name in os.listdir(root) if name.endswith(".py"))
    parts = ([], [])
    for i, name in enumerate(names):
        with open(os.path.join(root, name), "rb") as f:
            parts[i % 10 == 9].append(f.read())
    train, validation = (torch.frombuffer(bytearray(b"".join(p)), dtype=torch.uint8) for p in parts)
    if min(len(train), len(validation)) < 100_000:
        raise ConfigError(f"the standard library at {root} holds too little Python source to train on")
    return train, validation


def windows(text: torch.Tensor, starts: torch.Tensor, context: int) -> tuple:
    """Inputs and next-byte targets of the windows of ``context`` bytes at ``starts``."""
    rows = torch.stack([text[s : s + context + 1] for s in starts.tolist()]).long()
    return rows[:, :-1], rows[:, 1:]


def random_batch(text: torch.Tensor, batch_size: int, context: int, generator: torch.Generator) -> tuple:
    """``batch_size`` windows of ``text`` at starts drawn from ``generator``."""
    return windows(text, torch.randint(len(text) - context - 1, (batch_size,), generator=generator), context)


def validation_batches(text: torch.Tensor, count: int, batch_size: int, context: int) -> list:
    """The same evenly spaced windows every time, so losses compare across runs."""
    starts = torch.linspace(0, len(text) - context - 2, count * batch_size).long()
    return [windows(text, chunk, context) for chunk in starts.split(batch_size)]


# -- the model ------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm causal self-attention, then a 4x MLP, each with a residual."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for z in self.qkv(self.norm1(x)).split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, layers: int, width: int, heads: int, context: int, vocab: int = 256):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(layers)])
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean cross-entropy of the next byte."""
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        logits = self.head(self.norm(self.blocks(x)))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt(config: GPTConfig, seed: int = 0) -> GPT:
    """A GPT of ``config``'s size; the same weights for the same ``seed``."""
    torch.manual_seed(seed)
    return GPT(config.layers, config.width, config.heads, config.context)
