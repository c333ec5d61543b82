"""Error feedback: the memory of what a rank did not send, or sent inexactly.

What a compressor leaves out of a step is kept in a residual and added to
the next step's gradient (Seide et al., 2014; DGC; Stich et al., 2018), so
that every value is applied once, late but exactly: summed over ranks, what
was applied plus what the residuals hold is what came in.

The residual is state, and explicit: a ``Residual`` that the allreducer
holds, or that the caller holds and passes to ``allreduce(..., residual=)``
(the JAX transformation threads it through its optax state). It covers the
positions ``[lo, hi)`` of the global vector where this rank compresses: the
whole vector for ``topka``, the rank's region of the node's sum for
``hitopk``, nothing for an algorithm that sends everything exactly.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from .. import kernels
from ..kernels import passes


@dataclass
class Residual:
    """This rank's residual: ``values`` over ``span = (lo, hi)`` of the global vector."""

    span: Tuple[int, int]
    values: Any


class ErrorFeedback:
    """The residual of one allreducer, and the three things compressors do with it.

    Feedback is ``on`` once an algorithm asked for it (``wanted``) and said
    what to ``cover``. Off, ``add`` returns the fresh values themselves, and
    the other two do nothing: what is not sent is dropped.
    """

    def __init__(self, wanted: bool, xp: Any, dtype: np.dtype):
        self.wanted, self.on, self.xp, self.dtype = bool(wanted), False, xp, np.dtype(dtype)
        self.state = Residual((0, 0), xp.zeros(0, dtype=self.dtype))

    def cover(self, lo: int, hi: int) -> None:
        """Keep a residual over ``[lo, hi)`` of the global vector (when feedback is wanted)."""
        if self.wanted:
            self.on = True
            self.state = Residual((lo, hi), self.xp.zeros(hi - lo, dtype=self.dtype))

    @property
    def residual(self) -> Any:
        return self.state.values

    def on_residual(self, residual: "Residual") -> "ErrorFeedback":
        """This feedback working on ``residual`` (a caller's, for one call)
        instead of its own."""
        if residual is self.state:
            return self
        bound = copy.copy(self)
        bound.state = residual
        return bound

    def add(self, fresh: Any, part: slice = slice(None)) -> Any:
        """``fresh`` plus the residual's ``part``, summed into it (the array to
        compress from); with feedback off, ``fresh`` itself, left untouched."""
        if not self.on:
            return fresh
        acc = self.state.values[part]
        acc += fresh
        passes.book("feedback add", 2 * fresh.size, fresh.size)
        return acc

    def add_and_select(self, fresh: Any, selector: kernels.Selector, k: int, part: slice = slice(None),
                       clear: bool = False) -> Any:
        """``add`` of ``fresh`` into the residual's ``part`` (feedback on, host
        arrays), with ``selector``'s candidate pass riding on the add's sweep
        (``kernels.add_and_select``): the residual ends as ``add`` leaves it,
        and the positions within ``part`` that ``selector`` picks from it come back.
        A 16-bit ``fresh`` is widened in the same sweep; with ``clear``, zeroed there."""
        return kernels.add_and_select(selector, self.state.values[part], fresh, k, clear)

    def rescale(self, factor: float) -> None:
        """Multiply the residual by ``factor``: the gradients it is added to
        changed units (a loss scale, as GradScaler's, changed by a power of
        two, which is exact)."""
        if self.on:
            self.state.values *= self.dtype.type(factor)

    def forget(self, acc: Any, indices: Any) -> None:
        """Clear what was selected from ``acc`` (the residual): it is being sent."""
        if self.on:
            acc[indices] = 0

    def keep_rounding(self, acc: Any, indices: Any, values: Any, sent: Any) -> None:
        """Keep in ``acc`` what a lossy codec rounded away from ``values`` (sent as
        ``sent``) at ``indices`` (a slice, or positions). The
        difference is exact, since a value and its rounding lie within a factor
        of two (Sterbenz), except where float16 saturates a value beyond 65504:
        that difference is rounded like any sum."""
        if self.on:
            acc[indices] = values - sent

    def fits(self, state: Residual, memory: Any) -> bool:
        """Whether ``state`` may stand in for this allreducer's residual: the same
        span, and a writable array of ``memory`` of its length and dtype."""
        values, (lo, hi) = getattr(state, "values", None), self.state.span
        return (isinstance(state, Residual) and tuple(state.span) == (lo, hi) and memory.is_array(values)
                and values.shape == (hi - lo,) and values.dtype == self.dtype
                and getattr(values.flags, "writeable", True))
