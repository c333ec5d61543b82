"""Top-k selection as a compressor: which entries of a span to send.

A ``TopK`` picks the k entries of largest magnitude with a selector of its
own (a selector may keep a warm start, so every selection site has one),
has error feedback forget what it picked (it is being sent), and adds its
time, its k and its smallest picked magnitude to the allreducer's ledger.
Its k follows the density of the call (``Call.density``): a density may
change from one call to the next, up to the largest one declared, by which
the buffers were sized, with nothing rebuilt.
"""
from __future__ import annotations

import functools
import math
from fractions import Fraction
from typing import Any, Dict, Tuple

import numpy as np

from .. import kernels
from ..kernels import passes
from ..memory import HostMemory
from .settings import Call


@functools.lru_cache(maxsize=256)  # it takes about 18 us, and a schedule reuses few densities
def selection_size(density: float, length: int) -> int:
    """k for a vector of ``length``: ``max(1, ceil(density*length))``, at most ``length``.

    The density is taken as the decimal the user wrote (0.01 is 1/100), so
    that k does not depend on binary rounding (0.01*300 is not 3 in floats).
    """
    return min(length, max(1, math.ceil(Fraction(repr(float(density))) * length)))


class TopK:
    """k of a span, picked by ``selector``, k from the call's density, at
    most that of ``most_density``."""

    def __init__(self, selector: kernels.Selector, span: int, most_density: float, memory: HostMemory,
                 ledger: Dict[str, float]):
        self.selector, self.span, self.memory, self.ledger = selector, span, memory, ledger
        self.k_most = selection_size(most_density, span)

    def k(self, call: Call) -> int:
        """The call's k."""
        return selection_size(call.density, self.span)

    def __call__(self, acc: Any, call: Call) -> Tuple[Any, Any]:
        """(indices, values) of the k picked entries of ``acc``; with error
        feedback on, ``acc`` is the residual and keeps the rest."""
        k = self.k(call)
        if k == 0:  # an empty shard (fewer elements than shards)
            return self.memory.xp.zeros(0, dtype=np.int64), acc[:0].copy()
        start = self.memory.now()
        return self._picked(acc, self.selector(acc, k), start, call)

    def add_and_pick(self, fresh: Any, call: Call, part: slice = slice(None), clear: bool = False
                     ) -> Tuple[Any, Any]:
        """Error feedback's ``add`` of ``fresh`` into the residual's ``part``, then
        ``self`` of that part: on the host in one sweep over both arrays
        (``ErrorFeedback.add_and_select``), where the add and the selection's
        candidate pass would each read the residual; a 16-bit ``fresh`` is
        widened there too. Its time counts as selection.

        ``clear``: ``fresh`` is zero on return (it is the result array): the
        sweep zeroes it as it reads it, where a zero-fill would pass over it
        again; without a sweep (a device, feedback off, k of 0), a fill does."""
        k, feedback = self.k(call), call.feedback
        if not (feedback.on and self.memory.in_host_memory and k):
            picks = self(feedback.add(fresh, part), call)  # the values picked are copies
            if clear:
                fresh.fill(0)
                passes.book("zero-fill", 0, fresh.size)
            return picks
        start = self.memory.now()
        indices = feedback.add_and_select(fresh, self.selector, k, part, clear)
        return self._picked(feedback.residual[part], indices, start, call)

    def _picked(self, acc: Any, indices: Any, start: float, call: Call) -> Tuple[Any, Any]:
        """(indices, values) of the picks, forgotten by error feedback and booked."""
        values = acc[indices]
        call.feedback.forget(acc, indices)
        self.ledger["t_select"] += self.memory.now() - start
        self.ledger["k"] += len(indices)
        if len(values):
            self.ledger["threshold"] = min(self.ledger["threshold"], float(self.memory.xp.abs(values).min()))
        return indices, values
