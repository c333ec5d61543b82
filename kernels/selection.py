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
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Protocol

import numpy as np

from .magnitude import magnitude_keys, pick_top


class Selector(Protocol):
    def __call__(self, x: Any, k: int) -> Any: ...


# name -> (factory(**options) -> Selector, returns the exact top-k set)
_REGISTRY: Dict[str, tuple[Callable[..., Selector], bool]] = {}

#: Every registered method name mapped to True when it returns the exact top-k set.
SELECTORS: Dict[str, bool] = {}


def register(name: str, factory: Callable[..., Selector], exact: bool) -> None:
    """Add a method: ``factory(**options)`` must return a fresh selector."""
    _REGISTRY[name] = (factory, exact)
    SELECTORS[name] = exact


def make_selector(method: str = "mstopk", **options: Any) -> Selector:
    """A selector for ``method``; call it once per call site (it may hold state)."""
    if method not in _REGISTRY:
        raise ValueError(
            f"unknown top-k method {method!r}; known methods: {', '.join(sorted(_REGISTRY))}"
        )
    return _REGISTRY[method][0](**options)


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


def topk(x: Any, k: int, method: str = "mstopk", **options: Any) -> Any:
    """Positions of the ``min(k, x.size)`` entries of largest magnitude, ascending:
    NumPy indices of a NumPy array, CuPy indices of a CuPy array (selected on
    its device by ``device_select``, which needs numba-cuda)."""
    check_input(x, k)
    if is_cupy(x):
        from .device_select import device_topk

        return device_topk(x, k, method, **options)
    return make_selector(method, **options)(x, k)


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
