"""``powersgd`` against a serial model of PowerSGD written from the paper
(Vogels et al., NeurIPS'19, Algorithm 1 with error feedback): to rounding,
since its products of MPI's sums round by MPI's order. Exact invariants:
identical bits on every rank, conservation of what came in, a result of
rank at most r per matrix, vectors summed exactly."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits
from spar_comm import ConfigError, make_allreducer
from spar_comm.collectives.powersgd import SEED, plan

COMM = MPI.COMM_WORLD


class Model:
    """Every rank's PowerSGD, played serially: residual e_w, warm-started Q."""

    def __init__(self, p, n, rank, shapes, dtype):
        self.p, self.dtype = p, np.dtype(dtype)
        self.matrices, self.dense = plan(n, rank, shapes)
        rng = np.random.default_rng(SEED)  # the first Q: standard normal draws, matrix by matrix
        self.q = [rng.standard_normal((c, min(rank, r, c))).astype(self.dtype) for _, r, c in self.matrices]
        self.residuals = [np.zeros(n, self.dtype) for _ in range(p)]

    def step(self, grads):
        ms = [g.astype(self.dtype) + e for g, e in zip(grads, self.residuals)]
        out = np.zeros_like(ms[0])
        for i, (o, r, c) in enumerate(self.matrices):
            mats = [m[o : o + r * c].reshape(r, c) for m in ms]
            p_hat = np.linalg.qr(sum(m @ self.q[i] for m in mats))[0]
            mine = [m.T @ p_hat for m in mats]
            self.q[i] = sum(mine)
            out[o : o + r * c] = (p_hat @ self.q[i].T).reshape(-1)
            for w, m in enumerate(mats):
                self.residuals[w][o : o + r * c] = (m - p_hat @ mine[w].T).reshape(-1)
        for o, n in self.dense:
            out[o : o + n] = sum(m[o : o + n] for m in ms)
            for e in self.residuals:
                e[o : o + n] = 0
        return out / self.p


def rank_grads(step, n, dtype):
    rng = np.random.default_rng([step, 17])
    return [rng.standard_normal(n).astype(dtype) for _ in range(COMM.size)]


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-9), ("float32", 2e-4)])
@pytest.mark.parametrize("rank, shapes", [(1, None), (2, [(40, 30), (30,), (7, 5, 4)]), (4, [(64, 64)])])
def test_matches_the_papers_algorithm_to_rounding(topology, dtype, tolerance, rank, shapes):
    n = 1200 if shapes is None else sum(int(np.prod(s)) for s in shapes)
    reducer = make_allreducer("powersgd", topology, n, dtype, rank=rank, shapes=shapes)
    model = Model(COMM.size, n, rank, shapes, dtype)
    for step in range(4):
        grads = rank_grads(step, n, dtype)
        out = reducer.allreduce(grads[COMM.rank])
        expected = model.step(grads)
        scale = np.abs(expected).max()
        assert_all(COMM, np.abs(out - expected).max() <= tolerance * scale, f"step {step}: output off the model")
        residual = reducer.residual_full()
        assert_all(COMM, np.abs(residual - model.residuals[COMM.rank]).max() <= tolerance * np.abs(residual).max() * 10,
                   f"step {step}: residual off the model")
        assert_identical_bits(COMM, out, "output")
    reducer.free()


@pytest.mark.mpi(min_size=1)
def test_conservation_and_rank_r_results_and_exact_vectors(topology):
    shapes, n, r = [(50, 40), (40,)], 2040, 2
    reducer = make_allreducer("powersgd", topology, n, "float64", rank=r, shapes=shapes, average=False)
    applied, raw = np.zeros(n), np.zeros(n)
    for step in range(5):
        grads = rank_grads(step, n, "float64")
        raw += grads[COMM.rank]
        out = reducer.allreduce(grads[COMM.rank])
        applied += out
        assert_all(COMM, np.linalg.matrix_rank(out[:2000].reshape(50, 40), tol=1e-8 * np.abs(out).max()) <= r,
                   "a rank-r result of higher rank")
        assert_all(COMM, np.array_equal(out[2000:], sum(g[2000:] for g in grads)) or COMM.size > 2,
                   "the bias was not summed exactly")  # exact for up to two addends, whatever the order
    kept = COMM.allreduce(reducer.residual_full())
    error = np.abs(applied + kept - COMM.allreduce(raw)).max()
    assert_all(COMM, error <= 1e-10 * np.abs(COMM.allreduce(raw)).max(), f"conservation error {error:.3g}")
    assert_all(COMM, not reducer.residual_full()[2000:].any(), "a vector sent in full kept a residual")


@pytest.mark.mpi(min_size=1)
def test_a_rank_that_would_not_compress_sums_densely(topology):
    """Rank 8 of a 10 x 12 matrix is no smaller than the matrix: it is summed like dense."""
    n = 120
    dense = make_allreducer("dense", topology, n, "float32")
    power = make_allreducer("powersgd", topology, n, "float32", rank=8, shapes=[(10, 12)])
    grad = rank_grads(0, n, "float32")[COMM.rank]
    assert_all(COMM, np.array_equal(dense.allreduce(grad), power.allreduce(grad)), "not dense's bits")
    assert_all(COMM, not power.residual_full().any(), "a residual where everything was sent")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, options, words", [
    ("powersgd", dict(rank=0), "rank must be an integer >= 1, got 0"),
    ("powersgd", dict(rank=2, shapes=[(10, 10)]), "shapes cover 100 elements, the gradient has 120"),
    ("powersgd", dict(ranks=2), "powersgd takes no option 'ranks' (its options: rank, shapes)"),
    ("hitopk", dict(rank=2), "hitopk takes no option 'rank' (its options: none)"),
])
def test_bad_options_are_refused_on_every_rank(topology, algorithm, options, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make_allreducer(algorithm, topology, 120, "float32", **options)
