"""Exact top-k by threshold bracketing: ``threshold`` and its warm-started twin.

One sample, one pass, one small pick:

1. a strided sample of ``SAMPLE`` entries gives a key floor that, with high
   confidence, lies below the k-th largest magnitude;
2. one compiled pass collects every position at or above the floor (about
   1-2k candidates); if fewer than k came back the estimate was wrong and a
   lower floor is tried (the last one admits everything), so the answer never
   depends on the estimate, only the time does;
3. the exact top-k set (the selection contract, NaN largest, ties to the lowest
   positions) is picked among the candidates, which are already in ascending
   position order.

``threshold_warm`` replaces step 1 after its first call by the previous call's
k-th magnitude, lowered by a margin that adapts to how much the threshold
moves between calls: gradients change slowly from step to step.

Integer input has no float bit layout to scan; it is ranked through a full key
array (one copy), which is exact and still avoids a sort.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Optional

import numpy as np

from .magnitude import SAMPLE, candidates_from, float_layout, magnitude_keys, native, pick_top, sample_floors
from .selection import check_input, register


class Selection(NamedTuple):
    positions: np.ndarray  # the contract set, ascending
    key: Optional[int]  # key of the k-th largest magnitude (None when k >= n)
    candidates: int  # how many entries the last candidate pass admitted


def select(x: np.ndarray, k: int, floors=None) -> Selection:
    """The contract set of ``x`` with the figures a warm start needs.

    ``floors`` overrides where the candidate search starts (an iterable of
    ``(key floor, expected count)``); it is always followed by the sample floors.
    """
    check_input(x, k)
    n = x.size
    if k >= n:
        return Selection(np.arange(n, dtype=np.int64), None, n)
    x = native(x)
    layout = float_layout(x.dtype)
    positions = None
    if layout is None or n <= 4 * SAMPLE:  # small or integer: rank every key
        keys = magnitude_keys(x)
    else:
        search = sample_floors(x, layout, k)
        if floors is not None:
            search = itertools.chain(floors, search)
        positions, keys = candidates_from(x, layout, k, search)
    chosen, kth = pick_top(keys, k)
    if positions is None:
        return Selection(np.flatnonzero(chosen).astype(np.int64, copy=False), kth, n)
    return Selection(positions[chosen], kth, positions.size)


def key_to_value(key: Optional[int], dtype: np.dtype) -> Optional[float]:
    """The magnitude a key stands for (NaN for the NaN key), or None."""
    if key is None:
        return None
    layout = float_layout(dtype)
    if layout is None:
        return float(key)
    return float(np.array(key, dtype=layout.bits).view(np.dtype(dtype).newbyteorder("=")))


class Threshold:
    """Stateless exact selector; ``threshold`` holds the last k-th magnitude (for traces)."""

    def __init__(self) -> None:
        self.threshold: Optional[float] = None

    def __call__(self, x: np.ndarray, k: int) -> np.ndarray:
        result = select(x, k)
        self.threshold = key_to_value(result.key, x.dtype)
        return result.positions


class ThresholdWarm(Threshold):
    """Exact selector that starts each call from the previous call's k-th magnitude.

    The first floor is ``margin * previous threshold``. When the k-th magnitude
    fell below it (the floor admitted fewer than k entries and the sample took
    over) the margin is squared, i.e. widened; when the floor admitted more
    than ``1.5k`` entries (the sample floor admits about 1.2k) it is loosened
    towards 1. Keep one object per call site
    (per shard): the state describes one gradient's history.
    """

    def __init__(self, margin: float = 0.9) -> None:
        super().__init__()
        self.margin = checked_margin(margin)

    def __call__(self, x: np.ndarray, k: int) -> np.ndarray:
        check_input(x, k)
        floor = self.warm_floor(x.dtype)
        if floor is None:
            return super().__call__(x, k)
        result = select(x, k, [(floor, 2 * k)])
        self.threshold = key_to_value(result.key, x.dtype)
        self.margin = adapted_margin(self.margin, result.key, floor, result.candidates, k)
        return result.positions

    def warm_floor(self, dtype: np.dtype) -> Optional[int]:
        """The key this call's search starts from, ``margin`` times the last
        k-th magnitude; None before there is one (or for integers)."""
        layout = float_layout(dtype)
        previous = self.threshold
        if layout is None or previous is None or not 0.0 < previous < np.inf:
            return None
        return int(np.array(previous * self.margin, dtype=np.dtype(dtype).newbyteorder("=")).view(layout.bits))


def checked_margin(margin: float) -> float:
    if not 0.0 < margin < 1.0:
        raise ValueError(f"margin must lie in (0, 1), got {margin}")
    return margin


def adapted_margin(margin: float, kth_key: Optional[int], floor: int, admitted: int, k: int) -> float:
    """The warm start's next margin: squared (wider) when the k-th key fell below
    the floor, its square root (tighter) when the floor admitted more than 1.5k."""
    if kth_key is not None and kth_key < floor:
        return margin**2
    if admitted > 3 * k // 2:
        return margin**0.5
    return margin


register("threshold", Threshold, exact=True)
register("threshold_warm", ThresholdWarm, exact=True)
