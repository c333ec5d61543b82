"""Residuals carried to another world: the saved ranks' total, kept.

Error feedback's promise is that nothing sent is lost: summed over ranks,
what was applied plus what the residuals hold is what came in. A run
resumed on another number of ranks, or another layout of nodes, has other
spans (``hitopk`` shards by the node's size), so no saved residual fits a new
rank as it is. What must survive is their total: at each position, the sum
of the saved residuals that cover it, added in rank order (the rounding of
one sum). Each position's total goes to exactly one new rank that covers
it, the ``i mod c``-th of the ``c`` that do, so that the load spreads over
them and the total over the new ranks is the saved total, bit for bit.
"""
from __future__ import annotations

from typing import Callable, List, Sequence, Tuple

import numpy as np

Span = Tuple[int, int]


def total_over(span: Span, saved: Sequence[Span], read: Callable[[int], np.ndarray], dtype: np.dtype) -> np.ndarray:
    """The total over the ``saved`` ranks' residuals on ``span``: each saved
    rank's values over its own span (``read(rank)``, called only for ranks that
    overlap ``span``), added in rank order."""
    lo, hi = span
    total = np.zeros(hi - lo, dtype=dtype)
    for rank, (a, b) in enumerate(saved):
        start, stop = max(lo, a), min(hi, b)
        if start < stop:
            total[start - lo:stop - lo] += read(rank)[start - a:stop - a]
    return total


def kept_by(rank: int, spans: Sequence[Span]) -> np.ndarray:
    """Which positions of ``spans[rank]`` that rank keeps: of the ``c`` ranks
    whose spans cover position ``i``, the ``i mod c``-th (in rank order)."""
    lo, hi = spans[rank]
    keep = np.zeros(hi - lo, dtype=bool)
    edges = sorted({lo, hi, *(edge for span in spans for edge in span if lo < edge < hi)})
    for a, b in zip(edges, edges[1:]):
        covering = [r for r, (start, stop) in enumerate(spans) if start <= a and b <= stop]
        keep[a - lo:b - lo] = np.arange(a, b) % len(covering) == covering.index(rank)
    return keep


def redistributed(rank: int, spans: Sequence[Span], saved: Sequence[Span], read: Callable[[int], np.ndarray],
                  dtype: np.dtype) -> np.ndarray:
    """``rank``'s new residual over ``spans[rank]``: the saved total where it
    keeps the position, zero elsewhere."""
    values = total_over(spans[rank], saved, read, dtype)
    values[~kept_by(rank, spans)] = 0
    return values


def uncovered(spans: Sequence[Span], size: int) -> List[Span]:
    """The ranges of ``[0, size)`` that no span covers: where a saved total has
    no new rank to go to."""
    gaps, reached = [], 0
    for lo, hi in sorted(span for span in spans if span[0] < span[1]):
        if lo > reached:
            gaps.append((reached, lo))
        reached = max(reached, hi)
    return gaps + ([(reached, size)] if reached < size else [])


def lost(spans: Sequence[Span], size: int, saved: Sequence[Span], read: Callable[[int], np.ndarray],
         dtype: np.dtype) -> List[Span]:
    """The ranges that no new span covers where the ``saved`` residuals hold
    values: what a resume on ``spans`` would drop."""
    return [gap for gap in uncovered(spans, size) if total_over(gap, saved, read, dtype).any()]
