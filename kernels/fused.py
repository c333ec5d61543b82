"""Error feedback's add and a selection's candidate pass in one sweep.

A compressor with error feedback adds the fresh gradient into the residual
(read both, write the residual) and then selects from the sum, whose
candidate pass reads it all again. Here the candidate pass rides on the
add: the selector names the floor before the sum exists (its warm start,
or a strided sample of the sum to be, which costs a few thousand adds), the
sweep adds and collects every entry at or above the floor, and the selector
picks among those candidates alone. They hold every entry at or above the
k-th largest key whenever at least k came back, so an exact selector picks
the same positions, ties included, as from the whole sum; when fewer came
back the selector searches the sum itself, as it would have.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import passes
from .magnitude import SAMPLE, Fresh, float_layout, sample_floors, sample_step, scan
from .selection import Selector


def add_and_select(selector: Selector, values: np.ndarray, fresh: Fresh, k: int, clear: bool = False) -> np.ndarray:
    """``values += fresh`` (a 16-bit float ``fresh`` widened exactly to the
    float32 ``values``; a tuple of arrays added as their sum in order, as a
    node's parts of a shard are), then the positions ``selector`` picks from
    the sum: the same as ``values += fresh; selector(values, k)``, in one
    sweep over the arrays where the selector ranks candidates (``values`` a
    float array of over ``4 * SAMPLE`` entries and ``k`` below its length).
    ``clear``: ``fresh`` (an array of ``values``' dtype: the result array,
    ``out=grad``) is zeroed too, in the sweep where there is one, else by a
    fill after the add."""
    n = values.size
    layout = float_layout(values.dtype)
    if layout is None or n <= 4 * SAMPLE or k >= n:  # a small vector: its selectors rank every key anyway
        values += summed(fresh, slice(None), values.dtype)
        passes.book("feedback add", n * (1 + (len(fresh) if isinstance(fresh, tuple) else 1)), n)
        if clear:
            fresh.fill(0)
            passes.book("zero-fill", 0, n)
        return selector(values, k)
    floor, expect = first_floor(selector, values, fresh, k)
    positions, _ = scan(values, layout, floor, 2 * expect, fresh, clear)
    if positions.size < k:  # the floor was above the k-th key: the selector searches the sum
        return selector(values, k)
    return positions[selector(values[positions], k)]


def summed(fresh: Fresh, where: Any, dtype: np.dtype) -> np.ndarray:
    """``fresh[where]`` in ``dtype``; for a tuple, the sum of its parts there, in order."""
    if not isinstance(fresh, tuple):
        return fresh[where].astype(dtype, copy=False)
    total = fresh[0][where].astype(dtype)  # a copy: the parts stay as they are
    for part in fresh[1:]:
        total += part[where]
    return total


def first_floor(selector: Any, values: np.ndarray, fresh: Fresh, k: int) -> tuple:
    """The key floor the sweep collects from and how many it expects: the
    selector's warm start where it keeps one, else the sample floor of the sum to be."""
    warm = getattr(selector, "warm_floor", None)
    floor = warm(values.dtype) if warm is not None else None
    if floor is not None:
        return floor, k
    step = sample_step(values.size)
    with np.errstate(over="ignore", invalid="ignore"):  # as silent as the sweep's own add
        sample = values[step] + summed(fresh, step, values.dtype)
    return next(sample_floors(values, float_layout(values.dtype), k, sample))
