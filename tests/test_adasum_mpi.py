"""Adasum's defining properties under MPI, in every emulated node layout: the
same gradient everywhere comes back as itself, orthogonal node vectors as
their sum, opposite ones as zero, scaling every gradient by a power of two
scales the result exactly, and the bytes are those the module promises.
(Its agreement with the serial reference is in test_collectives_mpi.py.)"""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all, assert_identical_bits
from spar_comm import make_allreducer

COMM = MPI.COMM_WORLD
N = 1000


def integers(seed, n: int = N, dtype="float32") -> np.ndarray:
    """Multiples of 2**-6 below 2**12: node sums of six of them are exact."""
    return (np.random.default_rng(seed).integers(-(2**12), 2**12, n) * 2.0**-6).astype(dtype)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_the_same_gradient_everywhere_comes_back_unchanged(topology, dtype):
    g = integers(1, dtype=dtype)
    out = make_allreducer("adasum", topology, N, dtype).allreduce(g)
    assert_all(COMM, np.array_equal(out, g), f"max error {np.abs(out - g).max()}")
    if topology.equal_nodes:  # without averaging the node sums, each of its size times g, come back
        summed = make_allreducer("adasum", topology, N, dtype, average=False).allreduce(g)
        assert_all(COMM, np.array_equal(summed, g * topology.local_size), "average=False: not local_size * g")


@pytest.mark.mpi(min_size=1)
def test_orthogonal_node_vectors_add_up(topology):
    """Node m's ranks fill only positions i with i % nodes == m: the nodes'
    means are orthogonal, so Adasum returns their plain sum."""
    nodes, node = topology.num_nodes, topology.node
    grad = integers([2, COMM.rank])
    grad[np.arange(N) % nodes != node] = 0
    out = make_allreducer("adasum", topology, N).allreduce(grad)
    expected = np.zeros(N, np.float32)
    for m in range(nodes):
        members = [g for n, g in COMM.allgather((node, grad)) if n == m]
        expected += np.sum(members, axis=0, dtype=np.float32) / np.float32(len(members))
    assert_all(COMM, np.array_equal(out, expected), f"max error {np.abs(out - expected).max()}")
    assert_identical_bits(COMM, out, "output")


@pytest.mark.mpi(min_size=1)
def test_opposite_node_vectors_cancel(topology):
    """adasum(a, -a) = 1.5a - 1.5a = 0; nodes alternate g and -g, and the
    folded nodes past a power of two (node P+i into node i) agree in sign."""
    g = integers(3)
    out = make_allreducer("adasum", topology, N).allreduce(g if topology.node % 2 == 0 else -g)
    expected = g if topology.num_nodes == 1 else np.zeros(N, np.float32)
    assert_all(COMM, np.array_equal(out, expected), f"max |out| {np.abs(out).max()}")


@pytest.mark.mpi(min_size=1)
def test_scaling_every_gradient_scales_the_result(topology):
    """The coefficients depend only on directions: 8 g gives 8 adasum(g)."""
    grad = np.random.default_rng([4, COMM.rank]).standard_normal(N).astype(np.float32)
    reducer = make_allreducer("adasum", topology, N)
    once = reducer.allreduce(grad)
    scaled = reducer.allreduce(grad * 8)
    assert_all(COMM, np.array_equal(scaled, once * 8), f"max error {np.abs(scaled - once * 8).max()}")
    assert_identical_bits(COMM, once, "output")


@pytest.mark.mpi(min_size=1)
def test_bytes_are_the_shard_once_per_level_and_fold(topology):
    reducer = make_allreducer("adasum", topology, N)
    reducer.allreduce(integers([5, COMM.rank]))
    nodes, node, local = topology.num_nodes, topology.node, topology.local_size
    top = 1 << (nodes.bit_length() - 1)
    shard_bytes = reducer.allgather.region.nbytes
    sends = 1 if node >= top else (top.bit_length() - 1) + (node + top < nodes)
    combines = 0 if node >= top else (top.bit_length() - 1) + (node + top < nodes)
    intra = ((local - 1) * N * 4 // local + (local - 1) * shard_bytes
             + combines * (local - 1) * 24 * len(topology.rails))
    last = reducer.last
    assert_all(COMM, last["bytes_inter"] == sends * shard_bytes, f"inter {last['bytes_inter']}, {sends} shards expected")
    assert_all(COMM, last["bytes_intra"] == intra, f"intra {last['bytes_intra']}, expected {intra}")
    assert_all(COMM, last["k"] == N and last["threshold"] == 0, f"{last}")
