"""Top-k selection as a compressor: which entries of a span to send.

A ``TopK`` picks the k entries of largest magnitude with a selector of its
own (a selector may keep a warm start, so every selection site has one),
has error feedback forget what it picked (it is being sent), and adds its
time, its k and its smallest picked magnitude to the allreducer's ledger.
Its k follows the density of the call in progress (``CallDensity``): a
density may change from one call to the next, up to the largest one
declared, by which the buffers were sized, with nothing rebuilt.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Dict, Tuple

import numpy as np

from .. import kernels
from ..kernels import passes
from ..memory import HostMemory
from .feedback import ErrorFeedback


def selection_size(density: float, length: int) -> int:
    """k for a vector of ``length``: ``max(1, ceil(density*length))``, at most ``length``.

    The density is taken as the decimal the user wrote (0.01 is 1/100), so
    that k does not depend on binary rounding (0.01*300 is not 3 in floats).
    """
    return min(length, max(1, math.ceil(Fraction(repr(float(density))) * length)))


class CallDensity:
    """The density of the call in progress (``now``), and the largest a call
    may ask for (``most``), which sizes every buffer."""

    def __init__(self, density: float, most: float):
        self.default, self.most = float(density), float(most)
        self.now = self.default
        self._k: Dict[Tuple[float, int], int] = {}  # selection_size's, which takes about 18 us

    def k(self, span: int) -> int:
        key = (self.now, span)
        k = self._k.get(key)
        if k is None:
            if len(self._k) >= 256:  # a schedule of many densities: keep the memo small
                self._k.clear()
            k = self._k[key] = selection_size(self.now, span)
        return k

    def k_most(self, span: int) -> int:
        return selection_size(self.most, span)


class TopK:
    """k of a span, picked by ``selector``, k from the call's density."""

    def __init__(self, selector: kernels.Selector, span: int, density: CallDensity, feedback: ErrorFeedback,
                 memory: HostMemory, ledger: Dict[str, float]):
        self.selector, self.span, self.density = selector, span, density
        self.feedback, self.memory, self.ledger = feedback, memory, ledger

    @property
    def k(self) -> int:
        """This call's k."""
        return self.density.k(self.span)

    @property
    def k_most(self) -> int:
        """The largest k a call may ask for."""
        return self.density.k_most(self.span)

    def __call__(self, acc: Any) -> Tuple[Any, Any]:
        """(indices, values) of the k picked entries of ``acc``; with error
        feedback on, ``acc`` is the residual and keeps the rest."""
        k = self.k
        if k == 0:  # an empty shard (fewer elements than shards)
            return self.memory.xp.zeros(0, dtype=np.int64), acc[:0].copy()
        start = self.memory.now()
        return self._picked(acc, self.selector(acc, k), start)

    def add_and_pick(self, fresh: Any, part: slice = slice(None), clear: bool = False) -> Tuple[Any, Any]:
        """Error feedback's ``add`` of ``fresh`` into the residual's ``part``, then
        ``self`` of that part: on the host in one sweep over both arrays
        (``ErrorFeedback.add_and_select``), where the add and the selection's
        candidate pass would each read the residual; a 16-bit ``fresh`` is
        widened there too. Its time counts as selection.

        ``clear``: ``fresh`` is zero on return (it is the result array): the
        sweep zeroes it as it reads it, where a zero-fill would pass over it
        again; without a sweep (a device, feedback off, k of 0), a fill does."""
        k = self.k
        if not (self.feedback.on and self.memory.in_host_memory and k):
            picks = self(self.feedback.add(fresh, part))  # the values picked are copies
            if clear:
                fresh.fill(0)
                passes.book("zero-fill", 0, fresh.size)
            return picks
        start = self.memory.now()
        indices = self.feedback.add_and_select(fresh, self.selector, k, part, clear)
        return self._picked(self.feedback.residual[part], indices, start)

    def _picked(self, acc: Any, indices: Any, start: float) -> Tuple[Any, Any]:
        """(indices, values) of the picks, forgotten by error feedback and booked."""
        values = acc[indices]
        self.feedback.forget(acc, indices)
        self.ledger["t_select"] += self.memory.now() - start
        self.ledger["k"] += len(indices)
        if len(values):
            self.ledger["threshold"] = min(self.ledger["threshold"], float(self.memory.xp.abs(values).min()))
        return indices, values
