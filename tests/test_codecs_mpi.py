"""Value codecs inside the allreducers (values=), the sparse and the dense
ones: the serial reference with the codec's rounding written independently,
conservation of what was applied, identical bits on every rank, fewer bytes
between nodes, and the algorithms that take no codec refused on every rank."""
from __future__ import annotations

import re

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits
from reference import Reference
from spar_comm import ConfigError, make_allreducer
from spar_comm.collectives.checks import CODECS
from spar_comm.collectives.codecs import VALUES
from test_collectives_mpi import integer_grads

COMM = MPI.COMM_WORLD
STEPS = 3


def codec_cases():
    """(algorithm, values, indices, dtype, n, density): every value codec on every
    algorithm that takes one, and the index codec where (index, value) pairs travel."""
    for algorithm in CODECS["values"]:
        pairs = algorithm in CODECS["indices"]
        for values, indices in [(v, None) for v in VALUES] + ([(None, "auto"), ("int8", "auto")] if pairs else []):
            for dtype, n, density in [("float32", 1037, 0.3), ("float64", 600, 0.05)]:
                yield algorithm, values, indices, dtype, n, density
        if pairs:
            yield from ((algorithm, v, "auto", "float32", 140_000, 0.0002) for v in (None, "int8"))


@pytest.mark.openmpi
@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, values, indices, dtype, n, density", list(codec_cases()))
def test_matches_the_reference_with_the_codecs_rounding(topology, algorithm, values, indices, dtype, n, density):
    """At density 0.3 a record holds more than one int8 block and indices go as a
    bitmap; at 0.0002 of 140,000 as 16-bit gaps, some longer than 65,535.
    Index codecs are lossless: the reference ignores them. The dense
    algorithms' chunks of 1037 / p hold more than one int8 block too."""
    p, rank = COMM.size, COMM.rank
    reducer = make_allreducer(algorithm, topology, n, dtype, density=density, selector="exact", values=values,
                              indices=indices)
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, n, dtype, density, values=values)
    for step in range(STEPS):
        grads = integer_grads(n, step, p, n, dtype)  # sums exact in any order; 18 significant bits: 16-bit codecs round
        if n > 100_000:  # the largest entries at both ends: gaps of about n between the picks
            for g in grads:
                g[1000:-1000] *= np.array(2.0**-10, dtype)
        out = reducer.allreduce(grads[rank])
        assert_all(COMM, np.array_equal(out, ref.step(grads)), f"step {step}: output differs from the reference")
        assert_all(COMM, np.array_equal(reducer.residual_full(), ref.residuals[rank]), f"step {step}: residual differs")
        assert_identical_bits(COMM, out, "output")
    reducer.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", CODECS["values"])
@pytest.mark.parametrize("values", ["float16", "int8"])
def test_what_was_applied_plus_what_is_kept_is_what_came_in(topology, algorithm, values):
    n = 4099
    reducer = make_allreducer(algorithm, topology, n, "float32", density=0.01, selector="exact", average=False,
                              values=values)
    rng = np.random.default_rng([11, COMM.rank])
    applied, raw = np.zeros(n, np.float64), np.zeros(n, np.float64)
    for _ in range(4):
        grad = rng.standard_normal(n).astype(np.float32)
        raw += grad
        applied += reducer.allreduce(grad)
    error = np.abs(applied + COMM.allreduce(reducer.residual_full().astype(np.float64)) - COMM.allreduce(raw)).max()
    assert_all(COMM, error <= 1e-5 * np.abs(COMM.allreduce(raw)).max() * 4, f"conservation error {error:.3g}")


@pytest.mark.mpi(min_size=2)
def test_narrow_values_move_fewer_bytes_between_nodes():
    from spar_comm import Topology

    topology = Topology(ranks_per_node=1)  # every rank its own node: every pair crosses
    sent = {}
    for values in (None, "float16", "int8"):
        reducer = make_allreducer("topka", topology, 100_000, "float32", density=0.01, values=values)
        reducer.allreduce(np.random.default_rng(COMM.rank).standard_normal(100_000).astype(np.float32))
        sent[values] = reducer.last["bytes_inter"]
        reducer.free()
    topology.free()
    assert_all(COMM, sent[None] == 8 * 1000 * (COMM.size - 1) or sent[None] > sent["float16"] > sent["int8"], str(sent))
    assert_all(COMM, sent["float16"] / sent[None] == 6 / 8 and abs(sent["int8"] / sent[None] - 5.016 / 8) < 1e-3,
               str(sent))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["dense", "hier_dense"])
def test_a_dense_sum_in_16_bits_moves_half_the_bytes_between_nodes(algorithm):
    from spar_comm import Topology

    topology = Topology(ranks_per_node=1)
    n, sent = 64 * COMM.size * 256, {}
    for values in (None, "float16", "int8"):
        reducer = make_allreducer(algorithm, topology, n, "float32", values=values)
        reducer.allreduce(np.random.default_rng(COMM.rank).standard_normal(n).astype(np.float32))
        sent[values] = reducer.last["bytes_inter"]
        reducer.free()
    topology.free()
    ring = 2 * (COMM.size - 1) * 4 * n // COMM.size  # chunks of n / p: whole int8 blocks, 8-byte aligned
    assert_all(COMM, sent[None] == ring and sent["float16"] * 2 == ring and sent["int8"] * 4 == ring * (1 + 4 / 256),
               str(sent))


@pytest.mark.mpi(min_size=2)
def test_hitopk_with_int8_values_and_automatic_indices_moves_at_least_19x_fewer_bytes_between_nodes():
    from spar_comm import Topology

    topology = Topology(ranks_per_node=1)
    sent = {}
    for values, indices in ((None, None), ("int8", "auto")):
        reducer = make_allreducer("hitopk", topology, 1 << 20, "float32", density=0.001, values=values,
                                  indices=indices)
        reducer.allreduce(np.random.default_rng(COMM.rank).standard_normal(1 << 20).astype(np.float32))
        sent[values] = reducer.last["bytes_inter"]
        reducer.free()
    topology.free()
    assert_all(COMM, sent[None] / sent["int8"] >= 1.9, str(sent))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, values, words", [
    ("gtopk", "int8", "gtopk takes no values codec; values codecs apply to dense, hier_dense, topka, hitopk, "
                      "hitopk_leader"),
    ("adasum", "float16", "adasum takes no values codec"),
    ("topka", "int4", "values must be one of float32, float16, bfloat16, int8"),
    ("gtopk", None, "indices='auto': gtopk takes no indices codec; indices codecs apply to topka, hitopk"),
    ("dense", None, "indices='auto': dense takes no indices codec"),
])
def test_a_codec_where_none_applies_is_refused_on_every_rank(topology, algorithm, values, words):
    with pytest.raises(ConfigError, match=re.escape(words)):
        make_allreducer(algorithm, topology, 100, "float32", density=0.1, values=values,
                        indices="auto" if values is None else None)
