"""A density per call (``allreduce(density=)``, up to ``max_density``): every
sparse allreducer against the serial reference as the density moves from
call to call on one allreducer, and the calls refused alike on every rank,
with nothing changed: ranks that ask for different densities, and a density
beyond the most declared."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits
from reference import Reference, k_of
from spar_comm import ConfigError, make_allreducer
from spar_comm.collectives.checks import CODECS
from test_collectives_mpi import integer_grads

COMM = MPI.COMM_WORLD
SPARSE = ("topka", "gtopk", "hitopk", "hitopk_leader")
#: Up and down, the most declared included, each call's k another than the last's.
DENSITIES = [0.05, 0.3, 0.01, 0.2, 0.3, 0.002]


def cases():
    for algorithm in SPARSE:
        yield algorithm, None, None
        if algorithm in CODECS["values"]:
            yield algorithm, "float16", "auto"


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, values, indices", list(cases()))
def test_each_call_at_its_own_density_matches_the_reference(topology, algorithm, values, indices):
    """The reference plays each step at that step's density: k, the residuals,
    the (rounded) values on the wire, the same bits on every rank."""
    n, p, rank = 1037, COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, topology, n, "float32", density=0.01, selector="exact", values=values,
                              indices=indices, max_density=max(DENSITIES))
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, n, "float32", 0.01, values=values)
    for step, density in enumerate(DENSITIES):
        grads = integer_grads(n, step, p, n, "float32")
        out = reducer.allreduce(grads[rank], density=density)
        ref.density = density
        assert_all(COMM, np.array_equal(out, ref.step(grads)), f"step {step} (density {density}): output differs")
        assert_all(COMM, np.array_equal(reducer.residual_full(), ref.residuals[rank]),
                   f"step {step} (density {density}): residual differs")
        assert_identical_bits(COMM, out, "output")
        if algorithm == "topka":
            assert_all(COMM, reducer.last["k"] == k_of(density, n), f"k {reducer.last['k']} at density {density}")
    # A call without density= is at the allreducer's own.
    grads = integer_grads(n, 99, p, n, "float32")
    out = reducer.allreduce(grads[rank])
    ref.density = 0.01
    assert_all(COMM, np.array_equal(out, ref.step(grads)), "a call at the allreducer's density differs")
    reducer.free()


def refused_alike(call, *words: str) -> str:
    """The ConfigError ``call`` raises, the same message on every rank, naming ``words``."""
    with pytest.raises(ConfigError) as raised:
        call()
    message = str(raised.value)
    everyone = COMM.allgather(message)
    assert_all(COMM, len(set(everyone)) == 1, f"the ranks raised different messages: {everyone}")
    assert_all(COMM, all(word in message for word in words), message)
    return message


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", SPARSE)
def test_ranks_that_ask_for_different_densities_are_refused_alike_and_nothing_changes(topology, algorithm):
    n, rank = 500, COMM.rank
    reducer = make_allreducer(algorithm, topology, n, "float32", density=0.02, max_density=0.1, selector="exact")
    grad = np.arange(n, dtype=np.float32) * (rank + 1)
    reducer.allreduce(grad)
    before = reducer.residual_full().copy()
    refused_alike(lambda: reducer.allreduce(grad, density=0.05 if rank == 0 else 0.1),
                  "different densities", "rank 0: 0.05", "rank 1: 0.1")
    assert_all(COMM, np.array_equal(reducer.residual_full(), before), "a refused call changed the residual")
    out = reducer.allreduce(grad, density=0.1)  # the ranks agree again: the allreducer goes on
    assert_identical_bits(COMM, out, "output after a refusal")
    reducer.free()


@pytest.mark.mpi(min_size=1)
def test_a_density_beyond_the_most_declared_is_refused_on_every_rank(topology):
    n, last = 400, COMM.size - 1
    reducer = make_allreducer("hitopk", topology, n, "float32", density=0.01, max_density=0.1, selector="exact")
    grad = np.ones(n, dtype=np.float32)
    refused_alike(lambda: reducer.allreduce(grad, density=0.5 if COMM.rank == last else 0.1),
                  f"rank {last}: density= is not in (0, max_density] = (0, 0.1]")
    refused_alike(lambda: reducer.allreduce(grad, density="0.05"), "max_density")
    reducer.free()
    plain = make_allreducer("topka", topology, n, "float32", density=0.01)  # max_density: its own density
    refused_alike(lambda: plain.allreduce(grad, density=0.02), "(0, 0.01]")
    plain.free()


@pytest.mark.mpi(min_size=1)
def test_a_max_density_below_the_density_is_refused_when_made(topology):
    refused_alike(lambda: make_allreducer("topka", topology, 100, "float32", density=0.1, max_density=0.05),
                  "max_density must be in [density, 1]")
