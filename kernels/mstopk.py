"""MSTopK (Shi et al., MLSys'21): top-k by N threshold bisection steps, made robust.

The published algorithm (docs/design.md, Selection) bisects a ratio in [0, 1] for N steps; the
threshold ``t = mean + ratio * (max - mean)`` of the magnitudes is moved down
while at most k entries reach it and up while more than k do. It remembers
``thres1``, the threshold with the largest count ``k1 <= k``, and ``thres2``,
the one with the smallest count ``k2 > k``; it returns every entry at or above
``thres1`` and fills the remaining ``k - k1`` from the band
``thres2 <= |x| < thres1``.

What ours changes, and why:

* **Exactly ``min(k, n)`` positions for every input.** When no step found a
  count ``<= k`` (a tied maximum, all zeros, all equal) ``thres1`` stays unset
  and selects nothing, instead of everything; when no step found a count
  ``> k`` the band reaches down to zero.
* **The band is filled by magnitude**, ties to the lowest positions. The band
  holds at least ``k - k1`` entries, so the result is then exactly the top-k
  set of the selection contract: recall 1, and the method is registered as
  exact. After N = 30 steps the band is a few entries wide, so the fill costs
  next to nothing.
* **Counts are taken over a candidate set.** N passes over the whole array
  would cost N times a pass. A strided sample first bounds the k-th magnitude
  from below, one compiled pass collects every entry at or above that floor
  (about 1-2k entries; a lower floor is retried if fewer than k come back) and
  the N steps count among those, in one compiled loop (NumPy's comparison a
  step cost about as much again in calls and allocations). Above the floor
  these are the true counts; below it the true count is at least the
  candidate count ``>= k``, which can move the bisection only where the band
  then holds the same top-k set. The mean and maximum are the true ones over
  all of x, from one vectorised pass.
* **Counting is ``|x| >= t``** with ``t`` rounded up to the input's dtype, as
  real arithmetic means it (some copies are off by one here).
* **NaN and Inf.** The bisection range is the mean and maximum of the
  *finite* magnitudes. Non-finite entries reach every threshold, so they are
  always counted as large; among them NaN ranks above Inf, and all NaNs are
  equal (``magnitude`` explains the order). A NaN or Inf is therefore always
  selected (up to k of them, lowest positions first) and shows in the reduced
  gradient at once rather than hiding in an error-feedback residual.

Integer input runs the same steps on the exact integer magnitudes, over a full
key array (one copy).
"""
from __future__ import annotations

import functools
from typing import Any, Optional

import numba
import numpy as np

from .magnitude import SAMPLE, candidates_from, finite_stats, float_layout, magnitude_keys, native, pick_top, sample_floors
from .selection import check_input, register
from .threshold import key_to_value


def _full_stats(x: np.ndarray, keys: np.ndarray, finite_below: Optional[int]) -> tuple[float, float]:
    """``(mean, max)`` of the finite magnitudes, from a full key array (small or integer input)."""
    if finite_below is None:
        return float(keys.mean(dtype=np.float64)), float(keys.max())
    finite = keys < finite_below
    if not finite.any():
        return 0.0, 0.0
    a = np.abs(x[finite].astype(np.float64))
    return float(a.mean()), float(a.max())


@functools.lru_cache(maxsize=None)
def _rounding(dtype: np.dtype) -> tuple[int, np.ndarray]:
    """How ``_bisect`` rounds a threshold up to ``dtype`` (the ``kind`` it
    takes), and for float16, which Numba cannot compute in, the value of
    every non-negative key up to Inf's, ascending (a key is the smallest
    whose value is ``>= t``: a search)."""
    layout = float_layout(dtype)
    if layout is None:
        return 0, np.empty(0)
    if layout.bits is np.uint16:
        return 16, np.arange(layout.inf_key + 1, dtype=np.uint16).view(np.float16).astype(np.float64)
    return 8 * np.dtype(dtype).itemsize, np.empty(0)


@numba.njit(nogil=True, cache=True)
def _threshold_key(t, kind, table, top_key):  # pragma: no cover - compiled
    """The key of the smallest magnitude of the dtype ``>= t`` (``t >= 0``),
    as an unsigned 64-bit integer: ``t`` rounded up to the dtype, as real
    arithmetic means ``|x| >= t``; for integers, at most ``top_key``."""
    if kind == 0:  # integer magnitudes; a t past uint64's range (rounded up to 2**64) is the top
        return top_key if t >= 18446744073709551616.0 else min(np.uint64(np.ceil(t)), top_key)
    if kind == 16:
        return np.uint64(np.searchsorted(table, t))
    if kind == 32:
        single = np.empty(1, np.float32)
        single[0] = t  # rounded to the nearest float32
        bits = np.uint64(single.view(np.uint32)[0])
        return bits + np.uint64(1) if np.float64(single[0]) < t else bits  # then the next one up
    double = np.empty(1, np.float64)
    double[0] = t
    return double.view(np.uint64)[0]


@numba.njit(nogil=True, cache=True)
def _count_at_least(keys, key):  # pragma: no cover - compiled
    count = 0
    for i in range(keys.size):
        count += keys[i] >= key
    return count


@numba.njit(nogil=True, cache=True)
def _bisect(keys, k, steps, mean, top, kind, table, top_key):  # pragma: no cover - compiled
    """The N bisection steps over ``keys``: ``(thres1, k1, thres2, k2)``;
    ``thres1`` was set where ``k1 > 0``, ``thres2`` where ``k2 < keys.size``.
    Keys and thresholds compare in the keys' own unsigned type, exactly."""
    lo, hi = 0.0, 1.0
    thres1 = thres2 = np.uint64(0)
    k1, k2 = 0, keys.size
    for _ in range(steps):
        ratio = (lo + hi) / 2
        t = _threshold_key(mean + ratio * (top - mean), kind, table, top_key)
        c = _count_at_least(keys, keys.dtype.type(t))
        if c <= k:
            hi = ratio
            if c > k1:
                k1, thres1 = c, t
        else:
            lo = ratio
            if c < k2:
                k2, thres2 = c, t
    return thres1, k1, thres2, k2


def mstopk_select(x: np.ndarray, k: int, N: int = 30) -> tuple[np.ndarray, Optional[int]]:
    """The positions MSTopK picks (ascending) and the key of the smallest one picked."""
    check_input(x, k)
    n = x.size
    if k >= n:
        return np.arange(n, dtype=np.int64), None
    x = native(x)
    layout = float_layout(x.dtype)
    finite_below = None if layout is None else layout.inf_key
    if layout is None or n <= 4 * SAMPLE:
        positions = None
        keys = magnitude_keys(x)
        mean, top = _full_stats(x, keys, finite_below)
    else:
        mean, top = finite_stats(x, layout)
        positions, keys = candidates_from(x, layout, k, sample_floors(x, layout, k))
    kind, table = _rounding(x.dtype)
    top_key = np.uint64(_threshold_key(top, kind, table, np.uint64(keys.max())))  # typed again: a uint64
    thres1, k1, thres2, k2 = _bisect(keys, k, N, mean, top, kind, table, top_key)

    chosen = np.zeros(keys.size, dtype=bool) if k1 == 0 else keys >= keys.dtype.type(thres1)
    if k1 < k:  # the band lies below thres1, so its k-th pick is the smallest selected key
        band = np.flatnonzero(~chosen if k2 == keys.size else ~chosen & (keys >= keys.dtype.type(thres2)))
        fill, kth = pick_top(keys[band], k - k1)
        chosen[band[fill]] = True
    else:
        kth = int(keys[chosen].min())
    if positions is None:
        return np.flatnonzero(chosen).astype(np.int64, copy=False), kth
    return positions[chosen], kth


def checked_steps(N: Any) -> int:
    """The number of bisection steps, refused unless an integer >= 1."""
    if isinstance(N, bool) or not isinstance(N, (int, np.integer)) or N < 1:
        raise ValueError(f"N (bisection steps) must be an integer >= 1, got {N!r}")
    return int(N)


class MSTopK:
    """Selector for ``mstopk``; ``threshold`` holds the last smallest selected magnitude."""

    def __init__(self, N: int = 30) -> None:
        self.N = checked_steps(N)
        self.threshold: Optional[float] = None

    def __call__(self, x: np.ndarray, k: int) -> np.ndarray:
        positions, key = mstopk_select(x, k, self.N)
        self.threshold = key_to_value(key, x.dtype)
        return positions


register("mstopk", MSTopK, exact=True)
