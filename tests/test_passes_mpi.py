"""The fused sweep (error feedback's add and the selection's candidate pass
in one pass over memory) against the serial reference, on vectors long
enough to take it; and the passes one call makes against the table in
docs/design.md."""
from __future__ import annotations

import functools
import re

import ml_dtypes  # noqa: F401  (bfloat16)
import numpy as np
import pytest
from mpi4py import MPI

from conftest import ROOT
from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits, computed_on_rank_0
from reference import Reference
from spar_comm import Topology, make_allreducer
from spar_comm.bench.passes import counted_call
from spar_comm.kernels.magnitude import SAMPLE

COMM = MPI.COMM_WORLD
#: Past ``4 * SAMPLE`` the selectors search candidates instead of every key; so
#: does each half of this on a node of 2, and each of 2 shards a lone rank of 3 at 2 a node owns.
N = 8 * SAMPLE + 4099
DENSITY = 0.001
#: Each step's gradients scaled by a power of two (exact): a fall of 2^-8 puts a
#: warm start's floor above the k-th key, a rise of 2^8 fills its candidates past what it expected.
SCALES = (1.0, 2.0**-8, 2.0**8, 1.0)


@functools.lru_cache(maxsize=None)
def grads(step: int, p: int, dtype) -> tuple:
    """Every rank's gradient: multiples of 2**-4 below 2**4 in magnitude, scaled by
    a power of two, exact in every dtype, and every float32 sum of them over ranks
    and steps exact. Made once: a test copies what it hands the allreducer."""
    rng = np.random.default_rng([29, step])
    return tuple((rng.integers(-256, 256, N) * 2.0**-4 * SCALES[step]).astype(dtype) for _ in range(p))


@functools.lru_cache(maxsize=None)
def reference_steps(algorithm: str, dtype: str, ranks_per_node: int) -> tuple:
    """The reference's (output, this rank's residual) at each step: the same for
    every selector and either way of passing the result, so played once, by rank 0."""
    p = COMM.size
    wide = "float64" if dtype == "float64" else "float32"

    def play() -> list:
        ref = Reference(algorithm, p, ranks_per_node, N, wide, DENSITY)
        per_rank: list = [[] for _ in range(p)]
        for step in range(len(SCALES)):
            expected = ref.step([g.astype(wide) for g in grads(step, p, dtype)]).astype(dtype)
            for rank in range(p):
                per_rank[rank].append((expected, ref.residuals[rank].copy()))
        return per_rank

    return tuple(computed_on_rank_0(COMM, play))


#: (algorithm, dtype, in place): the quick tier's, then the full suite's.
SWEEPS = [(algorithm, dtype, in_place) for algorithm in ("topka", "hitopk", "gtopk")
          for dtype, in_place in (("float32", False), ("float32", True), ("bfloat16", False))] + [
    pytest.param(*case, marks=pytest.mark.slow)
    for case in [(a, d, False) for a in ("topka", "hitopk") for d in ("float64", "float16")] + [("topka", "bfloat16", True)]]


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, dtype, in_place", SWEEPS,
                         ids=lambda v: {True: "in_place", False: "new"}.get(v, v) if isinstance(v, bool) else v)
@pytest.mark.parametrize("selector", ["mstopk", "threshold_warm", "exact"])
def test_the_sweep_matches_the_serial_reference(topology, algorithm, dtype, in_place, selector):
    """In place (``out=grad``), the sweep zeroes the gradient as it reads it, for
    the result (a 16-bit one is widened: its result goes through a float32 array)."""
    if (in_place or algorithm == "gtopk") and COMM.size > 4:
        pytest.skip("the zeroing and gtopk's sweep do not depend on the world's size; 6 ranks on 2 cores "
                    "take the launch's time")
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, topology, N, dtype, density=DENSITY, selector=selector)
    for step, (expected, residual) in enumerate(reference_steps(algorithm, dtype, topology.emulated_ranks_per_node)):
        mine = grads(step, p, dtype)[rank].copy()
        if in_place:
            out = reducer.allreduce(mine, out=mine)
        else:
            mine.flags.writeable = step % 2 == 0  # read-only as a JAX array's NumPy view is, every other step
            out = reducer.allreduce(mine)
        assert_all(COMM, out.tobytes() == expected.tobytes(), f"step {step}: output differs from the reference")
        assert_all(COMM, reducer.residual_full().tobytes() == residual.tobytes(),
                   f"step {step}: residual differs from the reference")
        assert_identical_bits(COMM, out, "output")
    reducer.free()


def design_table() -> dict:
    """The rows of docs/design.md's passes table: (algorithm, ranks per node,
    selector, result) -> (passes, reads, writes)."""
    text = (ROOT / "docs" / "design.md").read_text()
    table = text[text.index("| algorithm | ranks per node | selector |"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip().replace("`", "") for cell in line.strip("|").split("|")]
        rows[cells[0], int(cells[1]), cells[2], cells[3]] = tuple(float(cell) for cell in cells[-3:])
    return rows


@pytest.mark.worlds(1, 2)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("row", sorted(design_table()), ids=lambda row: "-".join(map(str, row)).replace(" ", "_"))
def test_a_call_makes_the_passes_the_design_table_states(row):
    algorithm, ranks_per_node, selector, result = row
    if COMM.size % ranks_per_node:
        pytest.skip(f"a node of {ranks_per_node} ranks in a world of {COMM.size}")
    topology = Topology(ranks_per_node=ranks_per_node)
    reducer = make_allreducer(algorithm, topology, N, density=DENSITY, selector=selector, shared_buffer=True)
    grad = reducer.buffer
    grad[...] = np.random.default_rng([31, COMM.rank]).standard_normal(N)  # few ties: the sample floor holds
    counted = counted_call(reducer, grad, grad if result == "in place" else np.empty_like(grad))
    stated = design_table()[row]
    assert_all(COMM, (counted["passes"], counted["reads"], counted["writes"]) == pytest.approx(stated, abs=0.01),
               f"counted {counted}, the table says {stated}")  # abs: N is odd
    reducer.free()
    topology.free()
