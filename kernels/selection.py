"""The top-k selection interface and its registry of methods.

Contract of every method (docs/design.md, Selection): ``topk(x, k, method)`` returns the
positions of ``min(k, x.size)`` entries of largest ``|x|`` of a flat array, as
unique integers in ascending order. Exact methods (``SELECTORS[name] is True``)
return precisely ``{i : |x[i]| > t}`` plus the lowest positions with
``|x[i]| == t``, where ``t`` is the k-th largest magnitude, so that every exact
method gives the same bits on every machine. NaN counts as larger than every
number (Inf included) and all NaNs are equal, so a NaN is always selected
(``magnitude`` explains why); integer input is ranked by its exact ``|x|``.

A *selector* is a callable ``selector(x, k) -> indices`` made by
``make_selector(method, **options)``. Stateless methods are plain functions;
a stateful method (one that warm-starts from the previous call) gives each
call site its own object, so the allreducers keep one selector per shard.

This module holds the contract and one registry of methods, for the host
(``mstopk.py``, ``threshold.py``, ``exact`` below) and the device
(``device_select.py``, registered when it is imported); it imports none of
them. The package's ``topk`` and ``make_selector`` dispatch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Protocol, Tuple

import numpy as np

from .magnitude import magnitude_keys, pick_top


class Selector(Protocol):
    def __call__(self, x: Any, k: int) -> Any: ...


# (name, on the device) -> factory(**options) -> Selector
_REGISTRY: Dict[Tuple[str, bool], Callable[..., Selector]] = {}

#: Every host method's name mapped to True when it returns the exact top-k set.
SELECTORS: Dict[str, bool] = {}


def register(name: str, factory: Callable[..., Selector], exact: bool, device: bool = False) -> None:
    """Add a method: ``factory(**options)`` must return a fresh selector, of
    host arrays, or with ``device`` of device arrays (every device method is
    exact)."""
    _REGISTRY[(name, device)] = factory
    if not device:
        SELECTORS[name] = exact


def selector_of(method: str, device: bool, **options: Any) -> Selector:
    """A fresh selector of a registered ``method``; ValueError naming the known ones."""
    if (method, device) not in _REGISTRY:
        known = ", ".join(sorted(name for name, on_device in _REGISTRY if on_device == device))
        raise ValueError(f"unknown top-k method {method!r}; known {'on the device' if device else 'methods'}: {known}")
    return _REGISTRY[(method, device)](**options)


def check_input(x: Any, k: int) -> None:
    """Refuse what no method can select from, with a message naming the problem."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise TypeError(f"k must be an integer, got {type(k).__name__}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if getattr(x, "ndim", None) != 1:
        raise ValueError(f"top-k needs a flat (1-D) array, got shape {getattr(x, 'shape', None)}")
    kind = np.dtype(x.dtype).kind
    if kind not in "fiu":
        raise TypeError(f"top-k needs a real numeric array, got dtype {x.dtype}")


def is_cupy(x: Any) -> bool:
    """Whether ``x`` is a CuPy array (told without importing CuPy)."""
    return type(x).__module__.split(".")[0] == "cupy"


def namespace(x: Any) -> Any:
    """The array module of ``x``: CuPy for a CuPy array, NumPy otherwise."""
    if is_cupy(x):
        import cupy

        return cupy
    return np


def exact_topk(x: np.ndarray, k: int) -> np.ndarray:
    """The reference: partition every magnitude key, ties to the lowest positions.

    Keys order entries by ``|x|`` with NaN above every number (see
    ``magnitude``); the set is the one the module docstring defines.
    """
    check_input(x, k)
    n = x.size
    if k >= n:
        return np.arange(n, dtype=np.int64)
    return np.flatnonzero(pick_top(magnitude_keys(x), k)[0]).astype(np.int64, copy=False)


register("exact", lambda: exact_topk, exact=True)
