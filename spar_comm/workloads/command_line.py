"""The command line of the workloads: the flags of train_gpt.py and
train_cnn.py, and the models' size flags that bench_peers.py shares with
them, with the settings they make. The models take plain values; only this
module knows argparse."""
from __future__ import annotations

import argparse
import dataclasses

from ..cli import density, positive_float, positive_int
from ..collectives import ALGORITHMS
from .gpt import TINY, GPTConfig


def add_training_arguments(parser: argparse.ArgumentParser, batch_size: int, batch_of: str, optimizer: str,
                           lr: float) -> None:
    """What a workload's training script takes besides the model: the
    allreduce, its density, the steps and their batches, the learning rate of
    ``optimizer``, the seed and how often to evaluate."""
    parser.add_argument("--algorithm", default="hitopk", choices=[*ALGORITHMS, "auto"],
                        help="gradient allreduce (default: %(default)s)")
    parser.add_argument("--density", type=density, default=0.01, help="fraction of gradients sent (default: %(default)s)")
    parser.add_argument("--steps", type=positive_int, default=300, help="(default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help=f"{batch_of} per rank (default: %(default)s)")
    parser.add_argument("--lr", type=positive_float, default=lr, help=f"{optimizer} learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--eval-every", type=positive_int, default=50, help="steps (default: %(default)s)")


def add_gpt_arguments(parser: argparse.ArgumentParser) -> None:
    """The GPT's size flags (read back by ``gpt_config``)."""
    parser.add_argument("--layers", type=positive_int, default=GPTConfig.layers,
                        help="Transformer blocks (default: %(default)s)")
    parser.add_argument("--width", type=positive_int, default=GPTConfig.width, help="embedding width (default: %(default)s)")
    parser.add_argument("--heads", type=positive_int, default=GPTConfig.heads, help="attention heads (default: %(default)s)")
    parser.add_argument("--context", type=positive_int, default=GPTConfig.context,
                        help="bytes per sequence (default: %(default)s)")
    parser.add_argument("--tiny", action="store_true", help="smoke-test sizes as defaults: "
                        + ", ".join(f"--{k} {v}" for k, v in dataclasses.asdict(TINY).items()))


def gpt_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> GPTConfig:
    """The GPT that ``add_gpt_arguments``' flags ask for. --tiny's sizes are
    written into ``args`` too (flags given explicitly still win), so that a
    record of the flags says what ran; a width that the heads do not divide
    is a usage error."""
    if args.tiny:
        vars(args).update({k: v for k, v in dataclasses.asdict(TINY).items() if getattr(args, k) == parser.get_default(k)})
    if args.width % args.heads:
        parser.error(f"--width {args.width} must be a multiple of --heads {args.heads}")
    return GPTConfig(args.layers, args.width, args.heads, args.context)


def add_resnet_arguments(parser: argparse.ArgumentParser) -> None:
    """The ResNet's size flags: the channels of its first stage, and the digits' size."""
    parser.add_argument("--width", type=positive_int, default=64, help="channels of the first stage (default: %(default)s)")
    parser.add_argument("--image", type=positive_int, default=16, help="pixels a side (default: %(default)s)")
