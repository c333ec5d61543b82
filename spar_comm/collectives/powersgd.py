"""``powersgd``: PowerSGD (Vogels et al., NeurIPS'19), rank-r compression by one
power iteration a step, warm-started, with error feedback.

The flat gradient is cut into the matrices of the bucket's tensors (option
``shapes``: a tensor of shape (a, b, ...) is the a x (b*...) matrix; by
default the whole vector is one matrix, a x n/a with a the largest divisor
of n up to sqrt(n)). For each matrix M (the gradient plus this rank's
residual), with Q the last step's (at first the same random one on every rank):

1. P = M Q, summed over ranks (one Allreduce for the P of every matrix),
   then orthonormalised (QR);
2. Q = M^T P, summed over ranks (one Allreduce for every Q);
3. the result is P Q^T (over the ranks' number when averaging); the
   residual keeps M - P Q_mine^T.

Summed over ranks, the residuals and the result add up to the inputs, since
P (sum of Q_mine)^T = P Q^T. A tensor of one dimension, or a matrix that
rank r would not make smaller (r (a + b) >= a b), is summed densely, as
PyTorch's hook does. Every rank computes the same P, Q and result from the
same sums. Its result approximates the sum, so ``auto`` never picks it.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..consensus import raise_if_any
from .base import Allreducer
from .settings import Call

#: The seed of the first Q, the same on every rank.
SEED = 0


def as_matrix(shape: Sequence[int]) -> Optional[Tuple[int, int]]:
    """The matrix a tensor of ``shape`` is compressed as, or None for a vector."""
    if len(shape) < 2:
        return None
    return int(shape[0]), int(math.prod(shape[1:]))


def square_ish(n: int) -> Tuple[int, int]:
    """(a, n/a), a the largest divisor of n not above sqrt(n)."""
    a = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return a, n // a


def plan(size: int, rank: int, shapes: Optional[Sequence[Sequence[int]]]) -> Tuple[list, list]:
    """(offset, rows, cols) of each matrix compressed, and (offset, length) of each part summed densely."""
    matrices, dense, offset = [], [], 0
    for shape in shapes or [square_ish(size)]:
        length, matrix = int(math.prod(shape)), as_matrix(shape)
        if matrix is not None and rank * sum(matrix) < length:
            matrices.append((offset, *matrix))
        else:
            dense.append((offset, length))
        offset += length
    return matrices, dense


class PowerSGDAllreducer(Allreducer):
    name = "powersgd"
    sums = False
    approximates = True
    options = {"rank": 1, "shapes": None}

    def __init__(self, topology, size, *args, **kwargs):
        super().__init__(topology, size, *args, **kwargs)
        self.matrices, self.dense = plan(self.size, self.options["rank"], self.options["shapes"])
        xp, rng = self.xp, np.random.default_rng(SEED)
        self.q = [xp.asarray(rng.standard_normal((cols, min(self.options["rank"], rows, cols))).astype(self.dtype))
                  for _, rows, cols in self.matrices]
        self.p_shapes = [(rows, q.shape[1]) for (_, rows, _), q in zip(self.matrices, self.q)]
        self.p_all = xp.empty(sum(r * c for r, c in self.p_shapes), self.dtype)
        self.q_all = xp.empty(sum(q.size for q in self.q), self.dtype)
        self.dense_all = xp.empty(sum(length for _, length in self.dense), self.dtype)
        starts = np.cumsum([0] + [n for _, n in self.dense]).tolist()
        self.dense_parts = [((o, n), self.dense_all[s : s + n]) for (o, n), s in zip(self.dense, starts)]
        self.feedback.cover(0, self.size)

    def shared_state(self) -> Optional[np.ndarray]:
        """Every matrix's Q, the warm start of the next step, in one vector."""
        return self.memory.to_host(self.xp.concatenate([q.reshape(-1) for q in self.q])) if self.q else None

    def load_shared_state(self, values: np.ndarray) -> None:
        total = sum(q.size for q in self.q)
        problem = None if np.shape(values) == (total,) else f"saved Q holds {np.shape(values)} values, not {total}"
        raise_if_any(self.topology.world, problem)
        for q, part in zip(self.q, split(self.xp.asarray(values, dtype=self.dtype), [q.shape for q in self.q])):
            q[...] = part

    @classmethod
    def check_options(cls, size: int, options: Dict[str, Any]) -> Optional[str]:
        rank, shapes = options["rank"], options["shapes"]
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or rank < 1:
            return f"rank must be an integer >= 1, got {rank!r}"
        if shapes is not None:
            try:
                total = sum(math.prod(int(d) for d in shape) for shape in shapes)
            except (TypeError, ValueError):
                return f"shapes must be a list of tensor shapes, got {shapes!r}"
            if total != size:
                return f"shapes cover {total} elements, the gradient has {size}"
        return None

    def _reduce(self, grad: Any, call: Call) -> Any:
        xp = self.xp
        m_all = call.feedback.add(grad)  # M = gradient + residual, every matrix at once
        matrices = [m_all[o : o + r * c].reshape(r, c) for o, r, c in self.matrices]
        ps, qs = split(self.p_all, self.p_shapes), split(self.q_all, [q.shape for q in self.q])
        for m, q, p in zip(matrices, self.q, ps):
            p[...] = m @ q
        self.world.allreduce(self.p_all)
        for p in ps:
            p[...] = xp.linalg.qr(p)[0]
        for m, p, q in zip(matrices, ps, qs):
            q[...] = m.T @ p
        mine = split(self.q_all.copy(), [q.shape for q in self.q]) if self.error_feedback else None
        self.world.allreduce(self.q_all)
        out = self.output(call, zeroed=False)  # grad (perhaps ``out``) is read below only where out is not written
        for i, ((o, r, c), m, p, q) in enumerate(zip(self.matrices, matrices, ps, qs)):
            if mine is not None:
                m -= p @ mine[i].T  # the residual keeps what this rank's share did not carry
            out[o : o + r * c] = (p @ q.T).reshape(-1)
            self.q[i][...] = q  # the warm start of the next step
        self._sum_densely(m_all, out)
        self.last["k"] = self.p_all.size + self.q_all.size + self.dense_all.size  # values sent
        return self.averaged(out)

    def _sum_densely(self, m_all: Any, out: Any) -> None:
        """The vectors, and the matrices not worth compressing, summed exactly."""
        for (o, n), part in self.dense_parts:
            part[...] = m_all[o : o + n]
        if self.dense_parts:
            self.world.allreduce(self.dense_all)
        for (o, n), part in self.dense_parts:
            out[o : o + n] = part
            if self.error_feedback:
                m_all[o : o + n] = 0  # sent in full: nothing kept


def split(flat: Any, shapes: List[Tuple[int, int]]) -> List[Any]:
    """Views of ``flat`` as consecutive matrices of ``shapes``."""
    parts, start = [], 0
    for rows, cols in shapes:
        parts.append(flat[start : start + rows * cols].reshape(rows, cols))
        start += rows * cols
    return parts
