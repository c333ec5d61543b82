"""Serial NumPy models of the allreducers, written independently of the
package: the per-rank gradients go in as a list, and the reference plays every
rank and node itself. Selection is the exact top-k with ties to the lowest
index (a stable sort), which every exact method of the package must match.

Adasum's model is the binary tree over nodes the algorithm defines, with its
products in float64 summed shard by shard in shard order and its
combination in float64, the arithmetic the package promises.
"""
from __future__ import annotations

import math
from fractions import Fraction
from typing import Dict, List

import ml_dtypes
import numpy as np


def k_of(density: float, length: int) -> int:
    return min(length, max(1, math.ceil(Fraction(repr(density)) * length)))


def sorted_top_positions(a: np.ndarray, k: int) -> np.ndarray:
    """The k largest |a|, ties to the lowest position, ascending: the
    definition, the first k of a stable sort of -|a|."""
    order = np.argsort(-np.abs(a), kind="stable")
    return np.sort(order[:k])


def top_positions(a: np.ndarray, k: int) -> np.ndarray:
    """``sorted_top_positions`` (tests/test_reference.py holds the two equal),
    by the k-th largest magnitude instead of a sort of all of them: ten times
    faster on the long vectors of test_passes_mpi.py."""
    magnitude = np.abs(a)
    if k >= magnitude.size or not np.isfinite(magnitude).all():
        return sorted_top_positions(a, k)
    kth = np.partition(magnitude, magnitude.size - k)[magnitude.size - k]
    above = np.flatnonzero(magnitude > kth)
    tied = np.flatnonzero(magnitude == kth)[: k - above.size]
    return np.sort(np.concatenate([above, tied]))


def round_float32(v: np.ndarray) -> np.ndarray:
    big = float(np.finfo(np.float32).max)
    return np.clip(v, -big, big).astype(np.float32).astype(v.dtype)


def round_float16(v: np.ndarray) -> np.ndarray:
    return np.clip(v, -65504.0, 65504.0).astype(np.float16).astype(v.dtype)


def round_bfloat16(v: np.ndarray) -> np.ndarray:
    big = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    return np.clip(v, -big, big).astype(np.float32).astype(ml_dtypes.bfloat16).astype(v.dtype)


def round_int8_blocks(v: np.ndarray, block: int = 256) -> np.ndarray:
    """ZeRO++-style: blocks of ``block`` values, scale max|b| / 127 in float32, steps rounded to nearest."""
    out = np.empty_like(v)
    for start in range(0, v.size, block):
        big = float(np.finfo(np.float32).max)
        b = np.clip(v[start : start + block], -big, big).astype(np.float32)
        scale = np.float32(np.abs(b).max() / np.float32(127)) if b.size else np.float32(0)
        steps = np.clip(np.rint(b / scale), -127, 127) if scale > 0 else np.zeros_like(b)
        exact = steps.astype(np.float64) * np.float64(scale)
        out[start : start + block] = np.clip(exact, -big, big).astype(np.float32).astype(v.dtype)
    return out


#: What each value codec makes of the values it sends, written independently of the package.
ROUNDING = {"float32": round_float32, "float16": round_float16, "bfloat16": round_bfloat16, "int8": round_int8_blocks}


def reproducible() -> List[str]:
    """The algorithms a serial model matches bit for bit (all but those that approximate)."""
    from spar_comm import ALGORITHMS

    return [name for name, cls in ALGORITHMS.items() if not cls.approximates]


def node_list(p: int, ranks_per_node: int) -> List[List[int]]:
    return [list(range(first, min(first + ranks_per_node, p))) for first in range(0, p, ranks_per_node)]


class Reference:
    """Plays one algorithm over ``p`` ranks in nodes of ``ranks_per_node``."""

    def __init__(self, algorithm, p, ranks_per_node, n, dtype, density, error_feedback=True, average=True,
                 values=None):
        self.algorithm, self.p, self.n = algorithm, p, n
        self.dtype, self.density = np.dtype(dtype), density
        self.error_feedback, self.average = error_feedback, average
        self.rounding = ROUNDING[values] if values else None  # a value codec: what is sent, the rest kept
        self.nodes = node_list(p, ranks_per_node)
        self.residuals = [np.zeros(n, self.dtype) for _ in range(p)]

    def step(self, grads: List[np.ndarray]) -> np.ndarray:
        out = getattr(self, "_" + self.algorithm)([g.astype(self.dtype) for g in grads])
        if self.algorithm == "adasum":  # not a sum: averaging happens inside the nodes
            return out
        return out / self.p if self.average and self.p > 1 else out

    # -- selection with error feedback at one site ------------------------------------
    def _pick(self, rank: int, lo: int, hi: int, fresh: np.ndarray, k: int):
        """Add ``fresh`` to rank's residual over [lo, hi), pick k; returns (global idx, values)."""
        acc = self.residuals[rank][lo:hi] + fresh if self.error_feedback else fresh.copy()
        idx = top_positions(acc, k)
        values = acc[idx].copy()
        acc[idx] = 0
        if self.rounding is not None:
            sent = self.rounding(values)
            acc[idx] = values - sent
            values = sent
        if self.error_feedback:
            self.residuals[rank][lo:hi] = acc
        return idx + lo, values

    def _dense_sum(self, arrays) -> np.ndarray:
        total = np.zeros(self.n, self.dtype)
        for a in arrays:
            total = total + a
        return total

    # -- the algorithms ----------------------------------------------------------------
    def _coded(self, ranks: List[int], parts: List[np.ndarray], lo: int) -> np.ndarray:
        """The sum over ``ranks`` of ``parts`` (each at positions ``lo`` onwards),
        sent through the value codec as sums.py sends it: each rank's part in
        len(ranks) chunks, rounded, its rounding kept; each chunk's owner sums the
        rounded chunks in rank order, rounds that sum and keeps its rounding too."""
        length, q = len(parts[0]), len(ranks)
        chunks = [(j * length // q, (j + 1) * length // q) for j in range(q)]
        sent = []
        for rank, part in zip(ranks, parts):
            acc = self.residuals[rank][lo : lo + length] + part if self.error_feedback else part.copy()
            rounded = np.concatenate([self.rounding(acc[a:b]) for a, b in chunks])
            if self.error_feedback:
                self.residuals[rank][lo : lo + length] = acc - rounded
            sent.append(rounded)
        out = np.zeros(length, self.dtype)
        for owner, (a, b) in zip(ranks, chunks):
            total = sent[0][a:b].copy()
            for rounded in sent[1:]:
                total = total + rounded[a:b]
            out[a:b] = self.rounding(total)
            if self.error_feedback:
                self.residuals[owner][lo + a : lo + b] += total - out[a:b]
        return out

    def _dense(self, grads):
        if self.rounding is None:
            return self._dense_sum(grads)
        return self._coded(list(range(self.p)), grads, 0)

    def _hier_dense(self, grads):
        if self.rounding is None:
            return self._dense_sum(grads)
        out = np.zeros(self.n, self.dtype)
        sums = [self._dense_sum([grads[r] for r in node]) for node in self.nodes]
        shards = max(len(node) for node in self.nodes)
        for j in range(shards):  # the rail of shard j: its owner on every node
            lo, hi = j * self.n // shards, (j + 1) * self.n // shards
            owners = [node[j * len(node) // shards] for node in self.nodes]
            out[lo:hi] = self._coded(owners, [s[lo:hi] for s in sums], lo)
        return out

    def _topka(self, grads):
        out = np.zeros(self.n, self.dtype)
        k = k_of(self.density, self.n)
        for r, g in enumerate(grads):
            idx, values = self._pick(r, 0, self.n, g, k)
            np.add.at(out, idx, values)
        return out

    def _hitopk(self, grads):
        out = np.zeros(self.n, self.dtype)
        shards = max(len(node) for node in self.nodes)
        for node in self.nodes:
            node_sum = self._dense_sum([grads[r] for r in node])
            for j in range(shards):
                lo, hi = j * self.n // shards, (j + 1) * self.n // shards
                owner = node[j * len(node) // shards]
                idx, values = self._pick(owner, lo, hi, node_sum[lo:hi], k_of(self.density, hi - lo))
                np.add.at(out, idx, values)
        return out

    def _hitopk_leader(self, grads):
        out = np.zeros(self.n, self.dtype)
        for node in self.nodes:
            node_sum = self._dense_sum([grads[r] for r in node])
            idx, values = self._pick(node[0], 0, self.n, node_sum, k_of(self.density, self.n))
            np.add.at(out, idx, values)
        return out

    def _gtopk(self, grads):
        k = k_of(self.density, self.n)
        sets: Dict[int, Dict[int, float]] = {}
        for r, g in enumerate(grads):
            idx, values = self._pick(r, 0, self.n, g, k)
            sets[r] = dict(zip(idx.tolist(), values))
        step = 1
        while step < self.p:
            for r in range(0, self.p, 2 * step):
                if r + step < self.p:
                    sets[r] = self._merge(r, sets[r], sets.pop(r + step), k)
            step *= 2
        out = np.zeros(self.n, self.dtype)
        for i, v in sets[0].items():
            out[i] = v
        return out

    def _merge(self, rank, mine, theirs, k):
        union = sorted(set(mine) | set(theirs))
        summed = np.array(
            [self.dtype.type(mine.get(i, 0)) + self.dtype.type(theirs.get(i, 0)) for i in union], self.dtype
        )
        keep = top_positions(summed, k)
        if self.error_feedback:
            for pos in sorted(set(range(len(union))) - set(keep.tolist())):
                self.residuals[rank][union[pos]] += summed[pos]
        return {union[pos]: summed[pos] for pos in keep}

    def _adasum(self, grads):
        shards = max(len(node) for node in self.nodes)
        bounds = [(j * self.n // shards, (j + 1) * self.n // shards) for j in range(shards)]
        vectors = []
        for node in self.nodes:
            total = self._dense_sum([grads[r] for r in node])
            vectors.append(total / self.dtype.type(len(node)) if self.average and len(node) > 1 else total)
        top = 2 ** int(math.log2(len(vectors)))
        for i in range(len(vectors) - top):  # the nodes past a power of two fold in first
            vectors[i] = adasum_pair(vectors[i], vectors[top + i], bounds)
        width = 1
        while width < top:
            for m in range(0, top, 2 * width):
                vectors[m] = adasum_pair(vectors[m], vectors[m + width], bounds)
            width *= 2
        return vectors[0]


def adasum_pair(a: np.ndarray, b: np.ndarray, bounds) -> np.ndarray:
    """(1 - a.b/2|a|^2) a + (1 - a.b/2|b|^2) b in float64, products summed per shard."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    dot = aa = bb = 0.0
    for lo, hi in bounds:
        x, y = a64[lo:hi], b64[lo:hi]
        dot, aa, bb = dot + np.sum(x * y), aa + np.sum(x * x), bb + np.sum(y * y)
    ca = 1 - dot / (2 * aa) if aa > 0 else 1.0
    cb = 1 - dot / (2 * bb) if bb > 0 else 1.0
    return (ca * a64 + cb * b64).astype(a.dtype)
