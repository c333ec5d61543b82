"""Sparse helpers: scatter-add of (index, value) records, and distinct positions.
Both take NumPy or CuPy arrays alike."""
from __future__ import annotations

from typing import Any

import numpy as np

from .selection import namespace


def scatter_add(out: Any, indices: Any, values: Any) -> Any:
    """``out[indices[r]] += values[r]`` for every record r in order: positions
    repeated across records are summed, never overwritten, in record order, so
    every rank that adds the same gathered records obtains the same bits.

    NumPy's ``add.at`` adds one pair after another (2-4x faster here than a
    loop over records). A GPU's scatter-add would use atomics, whose order
    varies; ``add_records`` avoids them and gives the same bits.
    """
    if isinstance(out, np.ndarray):
        np.add.at(out, indices.ravel(), values.ravel())
        return out
    return add_records(out, indices, values)


def add_records(out: Any, indices: Any, values: Any) -> Any:
    """``scatter_add`` one record at a time: positions are distinct within a
    record (each is a top-k selection), so a record is one vectorised add."""
    for record_indices, record_values in zip(indices, values):
        out[record_indices] += record_values
    return out


def sorted_distinct(indices: Any) -> Any:
    """The distinct values of an index array, ascending. (``np.unique`` took 0.7 s
    for 335k indices with NumPy 2.4 here; a sort takes milliseconds.)"""
    xp = namespace(indices)
    ordered = xp.sort(indices)
    if ordered.size < 2:
        return ordered
    return ordered[xp.concatenate((xp.ones(1, dtype=bool), ordered[1:] != ordered[:-1]))]
