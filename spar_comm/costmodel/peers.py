"""Bytes that PyTorch's DistributedDataParallel sends between nodes per rank
and step, from the parameter shapes alone: what spar_comm is compared
against (drivers/bench_peers.py), where DDP itself counts nothing."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple

#: torch's default: compress a matrix only where that at least halves it.
MIN_COMPRESSION_RATE = 2


def ring_bytes(nbytes: float, ranks: int) -> float:
    """What a ring allreduce of ``nbytes`` over ``ranks`` sends from each rank: 2(p-1)/p n."""
    return 2 * (ranks - 1) / ranks * nbytes


def powersgd_elements(shapes: Sequence[Tuple[int, ...]], rank: int) -> Tuple[int, int, int]:
    """(uncompressed, P, Q) elements one PowerSGD step allreduces, by torch's
    rule: a tensor of 2+ dimensions is a matrix of shape[0] rows; it is
    compressed where (rows + columns) * rank * MIN_COMPRESSION_RATE < rows * columns."""
    whole = p = q = 0
    for shape in shapes:
        numel = math.prod(shape)
        rows = shape[0] if len(shape) > 1 else 0
        cols = numel // rows if rows else 0
        if rows and (rows + cols) * rank * MIN_COMPRESSION_RATE < numel:
            p, q = p + rows * rank, q + cols * rank
        else:
            whole += numel
    return whole, p, q


def ddp_bytes(mode: str, shapes: Sequence[Tuple[int, ...]], ranks: int, nodes: int) -> Optional[float]:
    """What DDP ``mode`` (ddp, ddp_fp16, ddp_powersgd_r<rank>) sends between
    nodes per rank and step for float32 gradients of ``shapes`` (the
    parameters that take gradients); None for a mode not priced here."""
    if nodes == 1:
        return 0.0
    elements = sum(math.prod(s) for s in shapes)
    if mode == "ddp":
        return ring_bytes(4 * elements, ranks)
    if mode == "ddp_fp16":
        return ring_bytes(2 * elements, ranks)
    if mode.startswith("ddp_powersgd_r"):
        whole, p, q = powersgd_elements(shapes, int(mode[len("ddp_powersgd_r"):]))
        return ring_bytes(4 * (whole + p), ranks) + ring_bytes(4 * q, ranks)
    return None
