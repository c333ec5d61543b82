"""Sparse helpers: scatter-add of (index, value) pairs into a dense vector."""
from __future__ import annotations

import numpy as np


def scatter_add(out: np.ndarray, indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """``out[indices] += values`` with duplicate indices summed, never overwritten.

    Pairs are added in the order given, so every rank that adds the same
    gathered buffer obtains the same bits.
    """
    np.add.at(out, indices, values)
    return out
