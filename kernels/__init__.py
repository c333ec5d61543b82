"""Compute kernels of spar_comm, free of MPI: top-k selection and sparse helpers.

Installed as ``spar_comm.kernels``. Everything here works on one rank's data;
the collectives in ``spar_comm`` call into it.
"""
from .selection import SELECTORS, Selector, make_selector, register, topk
from .finite import all_finite
from .sparse import scatter_add, sorted_distinct
from . import mstopk, threshold  # noqa: E402,F401  (register their methods)

__all__ = ["all_finite", "SELECTORS", "Selector", "make_selector", "register", "scatter_add", "sorted_distinct", "topk"]
