"""Error feedback as explicit state: a residual the caller holds
(``allreduce(..., residual=)``) gives the bits of the one the allreducer holds
and leaves that one alone; a state that is not this rank's is refused with
ConfigError on every rank, and nothing changes."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all
from spar_comm import ConfigError, Residual, make_allreducer
from test_collectives_mpi import integer_grads

COMM = MPI.COMM_WORLD
N = 1037
#: Every way a rank comes to keep a residual: selection, a lossy codec on a dense sum, a low-rank factor.
KEEPERS = [("topka", None), ("gtopk", None), ("hitopk", None), ("hitopk_leader", None), ("powersgd", None),
           ("dense", "int8"), ("hier_dense", "float16")]


def fresh_state(reducer) -> Residual:
    span, values = reducer.residual_state()
    return Residual(span, np.zeros_like(values))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, values", KEEPERS)
def test_a_state_held_by_the_caller_gives_the_bits_of_the_one_held_inside(topology, algorithm, values):
    inside = make_allreducer(algorithm, topology, N, density=0.05, selector="exact", values=values)
    outside = make_allreducer(algorithm, topology, N, density=0.05, selector="exact", values=values)
    state = fresh_state(outside)
    kept = False
    for step in range(3):
        grad = integer_grads(N, step, COMM.size, N, np.float32)[COMM.rank]
        expected = inside.allreduce(grad.copy())
        got = outside.allreduce(grad.copy(), residual=state)
        assert_all(COMM, np.array_equal(got, expected), f"step {step}: the result differs")
        assert_all(COMM, np.array_equal(state.values, inside.residual_state()[1]), f"step {step}: residual differs")
        assert_all(COMM, not outside.residual_full().any(), f"step {step}: the allreducer's own residual changed")
        kept = kept or bool(state.values.any())
    assert_all(COMM, COMM.allreduce(kept, op=MPI.LOR), "no rank kept a residual: the test checks nothing")
    inside.free()
    outside.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("wrong", ["span", "dtype", "read-only", "not a state"])
def test_a_state_that_is_not_this_ranks_is_refused_everywhere(topology, wrong):
    reducer = make_allreducer("topka", topology, N, density=0.05)
    state = fresh_state(reducer)
    state.values[:] = 1
    given = state
    if COMM.rank == COMM.size - 1:
        bad = Residual(state.span, state.values.copy())
        if wrong == "span":
            bad.span = (1, N + 1)
        elif wrong == "dtype":
            bad.values = bad.values.astype(np.float64)
        elif wrong == "read-only":
            bad.values.flags.writeable = False
        given = (state.span, state.values) if wrong == "not a state" else bad
    grad = np.ones(N, np.float32)
    with pytest.raises(ConfigError, match=f"rank {COMM.size - 1}: the residual is not a Residual of this rank's span"):
        reducer.allreduce(grad, residual=given)
    assert_all(COMM, np.array_equal(state.values, np.ones(N, np.float32)), "the state changed")
    assert_all(COMM, np.array_equal(grad, np.ones(N, np.float32)), "the gradient changed")
    reducer.free()
