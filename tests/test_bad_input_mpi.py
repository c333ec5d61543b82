"""Bad input raises the same error on every rank, and the allreducer (and the
communicators) still work afterwards: no rank was left inside a collective."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all
from spar_comm import (
    ALGORITHMS,
    ConfigError,
    GradientError,
    NonFiniteGradientError,
    Topology,
    make_allreducer,
)
from spar_comm.kernels import passes

COMM = MPI.COMM_WORLD
LAST = COMM.size - 1  # the rank that misbehaves


@pytest.fixture(scope="module")
def topology():
    topo = Topology(ranks_per_node=2)
    yield topo
    topo.free()


def raised_everywhere(error_type, call) -> str:
    """Run ``call`` on every rank; every rank must raise ``error_type``."""
    try:
        call()
    except error_type as error:
        message = str(error)
    else:
        message = None
    assert_all(COMM, message is not None, f"no {error_type.__name__} raised")
    messages = COMM.allgather(message)
    assert_all(COMM, len(set(messages)) == 1, f"ranks raised different messages: {messages}")
    return message


GOOD = np.arange(100, dtype=np.float32)
BAD_GRADIENTS = {
    "wrong length": (np.zeros(99, np.float32), GradientError, "wrong length"),
    "wrong dtype": (np.zeros(100, np.float64), GradientError, "wrong dtype"),
    "2-D": (np.zeros((10, 10), np.float32), GradientError, "not 1-D"),
    "non-contiguous": (np.zeros(200, np.float32)[::2], GradientError, "not contiguous"),
    "list": ([0.0] * 100, GradientError, "not a NumPy array"),
    "NaN": (np.where(GOOD == 5, np.nan, GOOD).astype(np.float32), NonFiniteGradientError, "non-finite"),
    "Inf": (np.where(GOOD == 5, -np.inf, GOOD).astype(np.float32), NonFiniteGradientError, "non-finite"),
}


@pytest.mark.openmpi
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
@pytest.mark.parametrize("case", list(BAD_GRADIENTS))
def test_bad_gradient_on_one_rank(topology, algorithm, case):
    bad, error_type, words = BAD_GRADIENTS[case]
    reducer = make_allreducer(algorithm, topology, 100, "float32", density=0.1, selector="exact")
    reducer.allreduce(GOOD)
    residual = reducer.residual_full()
    grad = bad if COMM.rank == LAST else GOOD
    message = raised_everywhere(error_type, lambda: reducer.allreduce(grad))
    assert_all(COMM, f"rank {LAST}: {words}" in message, message)
    assert_all(COMM, np.array_equal(residual, reducer.residual_full()), "the refused call changed the residual")
    out = reducer.allreduce(GOOD)  # still usable, on every rank
    assert_all(COMM, out.shape == (100,), "no result after a refused call")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_a_callers_finite_verdict_stands_for_the_check(topology, algorithm):
    """``finite=``: the caller found out in a pass of its own, so the call makes
    none; a False on one rank is refused on every rank as a NaN would be."""
    reducer = make_allreducer(algorithm, topology, 100, "float32", density=0.1, selector="exact")
    with passes.counting() as books:
        reducer.allreduce(GOOD, finite=True)
    assert_all(COMM, "finite" not in {name for name, _, _ in books}, f"a check pass despite finite=True: {books}")
    residual = reducer.residual_full()
    message = raised_everywhere(NonFiniteGradientError, lambda: reducer.allreduce(GOOD, finite=COMM.rank != LAST))
    assert_all(COMM, f"rank {LAST}: non-finite" in message, message)
    assert_all(COMM, np.array_equal(residual, reducer.residual_full()), "the refused call changed the residual")


BAD_SETTINGS = {
    "density 0": (dict(density=0.0), "density must be in (0, 1]"),
    "density 1.5": (dict(density=1.5), "density must be in (0, 1]"),
    "size 0": (dict(size=0), "size must be a positive integer"),
    "dtype int": (dict(dtype="int32"), "dtype must be one of"),
    "selector": (dict(selector="no_such"), "unknown selector"),
    "algorithm": (dict(algorithm="no_such"), "unknown algorithm"),
    "shared_buffer": (dict(shared_buffer="yes"), "shared_buffer must be True or False"),
}


@pytest.mark.openmpi
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", list(BAD_SETTINGS))
@pytest.mark.parametrize("everywhere", [True, False], ids=["all-ranks", "one-rank"])
def test_bad_settings(topology, case, everywhere):
    change, words = BAD_SETTINGS[case]
    settings = dict(algorithm="hitopk", size=100, dtype="float32", density=0.1, selector="exact")
    if everywhere or COMM.rank == LAST:
        settings.update(change)
    algorithm = settings.pop("algorithm")
    message = raised_everywhere(ConfigError, lambda: make_allreducer(algorithm, topology, **settings))
    assert_all(COMM, words in message, message)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("field, value", [("size", 101), ("dtype", "float64"), ("density", 0.2), ("shared_buffer", True)])
def test_ranks_that_disagree(topology, field, value):
    settings = dict(size=100, dtype="float32", density=0.1, selector="exact")
    if COMM.rank == LAST:
        settings[field] = value
    message = raised_everywhere(ConfigError, lambda: make_allreducer("topka", topology, **settings))
    assert_all(COMM, "disagree" in message and field in message, message)


@pytest.mark.mpi(min_size=2)
def test_ranks_that_disagree_on_algorithm(topology):
    algorithm = "gtopk" if COMM.rank == LAST else "topka"
    message = raised_everywhere(ConfigError, lambda: make_allreducer(algorithm, topology, 100, selector="exact"))
    assert_all(COMM, "algorithm" in message, message)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("value", [0, -2, "two"])
def test_bad_ranks_per_node(value):
    message = raised_everywhere(ConfigError, lambda: Topology(ranks_per_node=value))
    assert_all(COMM, "ranks_per_node" in message, message)


@pytest.mark.mpi(min_size=2)
def test_topology_disagreement():
    rpn = 2 if COMM.rank == LAST else 1
    message = raised_everywhere(ConfigError, lambda: Topology(ranks_per_node=rpn))
    assert_all(COMM, "disagree" in message, message)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("out", [np.zeros(99, np.float32), np.zeros(100, np.float64), np.zeros(200, np.float32)[::2]],
                         ids=["length", "dtype", "strided"])
def test_bad_out_on_one_rank(topology, out):
    reducer = make_allreducer("hitopk", topology, 100, "float32", density=0.1, selector="exact")
    target = out if COMM.rank == LAST else None
    message = raised_everywhere(GradientError, lambda: reducer.allreduce(GOOD, out=target))
    assert_all(COMM, f"rank {LAST}: out is not" in message, message)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", list(ALGORITHMS))
def test_bad_selector_options_refused_everywhere(topology, algorithm):
    """Options are tried on every rank, also where a rank selects nothing (the
    non-leaders of hitopk_leader, every rank of a dense algorithm)."""
    message = raised_everywhere(
        ConfigError,
        lambda: make_allreducer(algorithm, topology, 100, selector="mstopk", selector_options={"bogus": 1}),
    )
    assert_all(COMM, "refused its options" in message, message)


@pytest.mark.mpi(min_size=2)
def test_shared_memory_setting_that_differs_between_ranks(topology, monkeypatch):
    """SPAR_COMM_SHM=0 on one rank only: the node agrees on one Reduce_scatter."""
    if COMM.rank == LAST:
        monkeypatch.setenv("SPAR_COMM_SHM", "0")
    reducer = make_allreducer("hitopk", topology, 1000, density=0.05, selector="exact")
    kinds = topology.local.allgather(type(reducer.reduce_scatter).__name__)
    assert_all(COMM, len(set(kinds)) == 1, f"ranks of a node chose {kinds}")
    out = reducer.allreduce(np.ones(1000, np.float32))
    assert_all(COMM, out.shape == (1000,), "no result")
    reducer.free()


@pytest.mark.mpi(min_size=1)
def test_residual_state_that_does_not_fit_is_refused_everywhere(topology):
    reducer = make_allreducer("topka", topology, 100, density=0.1, selector="exact")
    span, values = reducer.residual_state()
    if COMM.rank == LAST:
        span, values = (0, 99), values[:99]
    message = raised_everywhere(ConfigError, lambda: reducer.load_residual_state(span, values))
    assert_all(COMM, f"rank {LAST}: saved residual covers (0, 99)" in message or COMM.size == 1, message)
