"""16-bit gradients (float16, bfloat16) in every allreducer. They are reduced
in float32 and rounded once at the end, so the result is the float32
reference's rounded to the gradient's dtype, bit for bit on every rank; the
residuals stay float32, and conservation holds for the float32 result (the
final rounding, which is not fed back, is the only difference).

The widening happens before any algorithm runs, so one node layout is
enough here (nodes of 2, uneven at odd world sizes); test_collectives_mpi.py
covers every layout in float32 and float64."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits
from reference import Reference, reproducible
from spar_comm import ALGORITHMS, GradientError, Topology, make_allreducer

COMM = MPI.COMM_WORLD
HALF = ["float16", "bfloat16"]
#: Unit roundoff of each: the largest relative error of one rounding.
ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}


@pytest.fixture(scope="module")
def topology():
    topo = Topology(ranks_per_node=2)
    yield topo
    topo.free()


def half_grads(seed: int, step: int, p: int, n: int, dtype) -> list:
    """Multiples of 2**-4 below 2**4 in magnitude: exact in both 16-bit formats
    (8 significant bits), and every float32 sum of them over ranks and steps
    is exact, whatever order MPI adds in."""
    rng = np.random.default_rng([seed, step])
    return [(rng.integers(-256, 256, n) * 2.0**-4).astype(dtype) for _ in range(p)]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", reproducible())
@pytest.mark.parametrize("dtype", HALF)
def test_matches_the_float32_reference_rounded_once(topology, algorithm, dtype):
    p, rank, n, density = COMM.size, COMM.rank, 1000, 0.05
    reducer = make_allreducer(algorithm, topology, n, dtype, density=density, selector="exact")
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, n, "float32", density)
    buffer = np.zeros(n, dtype)
    for step in range(3):
        grads = half_grads(11, step, p, n, dtype)
        if step == 1:  # into the caller's array
            assert_all(COMM, reducer.allreduce(grads[rank], out=buffer) is buffer, "out= was not returned")
            out = buffer
        else:
            out = reducer.allreduce(grads[rank])
        expected = ref.step([g.astype(np.float32) for g in grads]).astype(dtype)
        assert_all(COMM, same_bits(out, expected), f"step {step}: output differs from the rounded reference")
        residual = reducer.residual_full()
        assert_all(COMM, same_bits(residual, ref.residuals[rank]), f"step {step}: residual differs ({residual.dtype})")
        assert_identical_bits(COMM, out, "output")
    reducer.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", [name for name, cls in ALGORITHMS.items() if cls.sums])
@pytest.mark.parametrize("dtype", HALF)
def test_conservation_in_float32(topology, algorithm, dtype):
    """Applied updates plus float32 residuals equal the raw gradients, summed
    over ranks and steps, up to float32 sums and one rounding of each result."""
    n, rank, steps = 1000, COMM.rank, 4
    reducer = make_allreducer(algorithm, topology, n, dtype, density=0.01, selector="exact", average=False)
    rng = np.random.default_rng([13, rank])
    applied, raw = np.zeros(n), np.zeros(n)
    rounding = 0.0
    for _ in range(steps):
        grad = rng.standard_normal(n).astype(dtype)
        raw += grad.astype(np.float64)
        out = reducer.allreduce(grad).astype(np.float64)
        applied += out
        rounding += np.abs(out).max() * ROUNDOFF[dtype]
    kept = COMM.allreduce(reducer.residual_full().astype(np.float64))
    raw_total = COMM.allreduce(raw)
    error = np.abs(applied + kept - raw_total).max()
    tolerance = 1e-5 * np.abs(raw_total).max() * steps + rounding
    assert_all(COMM, error <= tolerance, f"conservation error {error:.3g} > {tolerance:.3g}")
    assert_all(COMM, reducer.residual_full().dtype == np.float32, "the residual is not float32")
    assert_identical_bits(COMM, applied, "applied updates")


@pytest.mark.mpi(min_size=1)
def test_a_gradient_of_another_16_bit_dtype_is_refused_everywhere(topology):
    reducer = make_allreducer("hitopk", topology, 100, "bfloat16", density=0.1)
    grad = np.ones(100, np.float16 if COMM.rank == COMM.size - 1 else ml_dtypes.bfloat16)
    with pytest.raises(GradientError, match=f"rank {COMM.size - 1}: wrong dtype"):
        reducer.allreduce(grad)
    grad = np.ones(100, ml_dtypes.bfloat16)
    grad[0] = np.inf if COMM.rank == 0 else 1
    with pytest.raises(GradientError, match="rank 0: non-finite"):
        reducer.allreduce(grad)
    reducer.free()
