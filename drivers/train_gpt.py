#!/usr/bin/env python
"""A small GPT (a decoder-only Transformer, about 11M parameters by default)
trained on the Python standard library's own sources, bytes as tokens. A
plain PyTorch script made data-parallel by spar_comm: the lines marked
``# spar_comm`` are the whole change.

    mpiexec -n 4 python drivers/train_gpt.py
    mpiexec -n 2 python drivers/train_gpt.py --tiny --steps 20 --algorithm dense

The text is the top-level ``*.py`` files of the standard library of the
Python that runs the script, in name order; every tenth file is held out for
validation. Emulated nodes: SPAR_COMM_RANKS_PER_NODE=2.
"""
import argparse
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

import spar_comm.torch as sct                                                        # spar_comm
from spar_comm import ALGORITHMS, retain_freed_memory
from spar_comm.cli import density, positive_float, positive_int
from spar_comm.errors import ConfigError
from spar_comm.launch import run_main

#: --tiny: a model and context small enough for a smoke test.
TINY = dict(layers=2, width=32, heads=2, context=32)


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


def build_model(args: argparse.Namespace) -> GPT:
    torch.manual_seed(args.seed)
    return GPT(args.layers, args.width, args.heads, args.context)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The model's size flags (shared with bench_peers.py)."""
    parser.add_argument("--layers", type=positive_int, default=6, help="Transformer blocks (default: %(default)s)")
    parser.add_argument("--width", type=positive_int, default=384, help="embedding width (default: %(default)s)")
    parser.add_argument("--heads", type=positive_int, default=6, help="attention heads (default: %(default)s)")
    parser.add_argument("--context", type=positive_int, default=128, help="bytes per sequence (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="smoke-test sizes as defaults: "
                        + ", ".join(f"--{k} {v}" for k, v in TINY.items()))


def settle_model_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.tiny:  # smaller defaults: flags given explicitly still win
        vars(args).update({k: v for k, v in TINY.items() if getattr(args, k) == parser.get_default(k)})
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="train_gpt.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="hitopk", choices=[*ALGORITHMS, "auto"],
                        help="gradient allreduce (default: %(default)s)")
    parser.add_argument("--density", type=density, default=0.01, help="fraction of gradients sent (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=300, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per rank (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--eval-every", type=positive_int, default=50, help="steps (default: %(default)s)")
    parser.add_argument("--eval-batches", type=positive_int, default=8, help="(default: %(default)s)")
    add_model_arguments(parser)
    args = parser.parse_args(argv)
    settle_model_arguments(parser, args)
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    train, validation = stdlib_text()
    held_out = validation_batches(validation, args.eval_batches, args.batch_size, args.context)
    generator = torch.Generator().manual_seed(args.seed * 1000 + sct.rank())       # spar_comm

    model = build_model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sct.broadcast_parameters(model)                                                  # spar_comm
    optimizer = sct.DistributedOptimizer(optimizer, model.named_parameters(),        # spar_comm
                                         algorithm=args.algorithm, density=args.density)
    if sct.rank() == 0:                                                              # spar_comm
        print(f"{sum(p.numel() for p in model.parameters()):,} parameters, {len(train):,} training bytes, "
              f"{len(validation):,} validation bytes", flush=True)

    for step in range(1, args.steps + 1):
        optimizer.zero_grad()
        loss = model(*random_batch(train, args.batch_size, args.context, generator))
        loss.backward()
        optimizer.step()
        if step % args.eval_every == 0 or step == args.steps:
            model.eval()
            with torch.no_grad():
                val = sum(model(x, y).item() for x, y in held_out) / len(held_out)
            model.train()
            if sct.rank() == 0:                                                      # spar_comm
                print(f"step {step:5d}  train loss {loss.item():.4f}  validation loss {val:.4f}", flush=True)


if __name__ == "__main__":
    run_main(main, "train_gpt.py")
