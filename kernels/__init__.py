"""Compute kernels of spar_comm, free of MPI: top-k selection and sparse helpers.

Installed as ``spar_comm.kernels``. Everything here works on one rank's data;
the collectives in ``spar_comm`` call into it. ``topk`` and ``make_selector``
are the one way to a selection method, on the host or on a device.
"""
from typing import Any, Optional

from .selection import SELECTORS, Selector, check_input, is_cupy, register, selector_of
from .finite import all_finite, copy_all_finite
from .fused import add_and_select
from .sparse import scatter_add, sorted_distinct
from . import mstopk, threshold  # noqa: E402,F401  (register their methods)

__all__ = ["add_and_select", "all_finite", "copy_all_finite", "SELECTORS", "Selector", "make_selector", "register", "scatter_add", "sorted_distinct", "topk"]


def make_selector(method: str = "mstopk", device: bool = False, **options: Any) -> Selector:
    """A selector for ``method``; call it once per call site (it may hold state).
    ``device``: one of device arrays (numba-cuda's kernels, CUDA C for CuPy)."""
    if device:
        from . import device_select  # noqa: F401  (registers the device methods; needs numba-cuda)
    return selector_of(method, device, **options)


def topk(x: Any, k: int, method: str = "mstopk", device: Optional[bool] = None, **options: Any) -> Any:
    """Positions of the ``min(k, x.size)`` entries of largest magnitude, ascending:
    NumPy indices of a NumPy array, CuPy indices of a CuPy array (selected on
    its device). ``device=True`` takes the device kernels for any array (under
    Numba's CUDA simulator, NumPy's)."""
    check_input(x, k)
    return make_selector(method, device=is_cupy(x) if device is None else device, **options)(x, k)
