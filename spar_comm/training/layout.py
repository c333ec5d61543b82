"""Named parameter tensors as views of one flat vector.

Parameters, gradients and optimizer state each live in one contiguous flat
array (the fused buffer), so a step makes one allreduce call instead of one
per tensor; models see the flat array through named, shaped views.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Sequence, Tuple


class ParamLayout:
    """Where each named tensor sits in the flat vector, in declaration order."""

    def __init__(self, shapes: Sequence[Tuple[str, Tuple[int, ...]]]):
        self.names: List[str] = [name for name, _ in shapes]
        self.shapes: Dict[str, Tuple[int, ...]] = dict(shapes)
        self.offsets: Dict[str, Tuple[int, int]] = {}
        start = 0
        for name, shape in shapes:
            self.offsets[name] = (start, start + math.prod(shape))
            start += math.prod(shape)
        self.size = start

    def views(self, flat: Any, xp: Any) -> Dict[str, Any]:
        """Shaped views into ``flat`` (writes through them reach ``flat``)."""
        return {name: xp.reshape(flat[lo:hi], self.shapes[name]) for name, (lo, hi) in self.offsets.items()}
