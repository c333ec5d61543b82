"""Serial checks of the pieces under the collectives: shards, k, pair records,
and the emulated node size from the environment."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mpi4py import MPI

from spar_comm import ConfigError, Topology, selection_size
from spar_comm.collectives.pairs import PairLayout
from spar_comm.topology import ENV_RANKS_PER_NODE, shard_bounds, shard_owner


@given(n=st.integers(0, 10**7), parts=st.integers(1, 64))
def test_shards_partition_the_vector_in_balanced_pieces(n, parts):
    bounds = [shard_bounds(n, parts, j) for j in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [hi - lo for lo, hi in bounds]
    assert max(sizes) - min(sizes) <= 1


@given(shards=st.integers(1, 16), data=st.data())
def test_every_rank_of_a_smaller_node_owns_a_contiguous_run(shards, data):
    node_size = data.draw(st.integers(1, shards))
    owners = [shard_owner(j, node_size, shards) for j in range(shards)]
    assert owners == sorted(owners)
    assert set(owners) == set(range(node_size))


@pytest.mark.parametrize(
    "density, length, k",
    [(0.01, 300, 3), (0.001, 1000, 1), (0.001, 1001, 2), (1e-9, 5, 1), (1.0, 7, 7), (0.5, 1, 1), (0.07, 100, 7)],
)
def test_selection_size_takes_the_density_as_written(density, length, k):
    assert selection_size(density, length) == k


@settings(max_examples=60)
@given(k=st.integers(0, 50), dtype=st.sampled_from(["float16", "float32", "float64"]), records=st.integers(1, 5))
def test_pair_records_round_trip(k, dtype, records):
    layout = PairLayout(k, np.dtype(dtype))
    assert layout.nbytes % 8 == 0
    buf = layout.empty(records)
    rng = np.random.default_rng(k)
    written = []
    for r in range(records):
        values, indices = layout.views(buf, r)
        assert values.flags.aligned and indices.flags.aligned
        pair = (rng.standard_normal(k).astype(dtype), rng.integers(0, 2**31 - 1, k, dtype=np.int32))
        values[:], indices[:] = pair
        written.append(pair)
    all_values, all_indices = layout.all_views(buf, records)
    assert np.array_equal(all_values, np.array([v for v, _ in written]).reshape(records, k))
    assert np.array_equal(all_indices, np.array([i for _, i in written]).reshape(records, k))


def test_a_lone_process_is_one_node_of_one_rank():
    topology = Topology(MPI.COMM_SELF)
    assert (topology.num_nodes, topology.local_size, topology.my_shards) == (1, 1, [0])
    assert "1 ranks as 1 x 1" in topology.describe()
    topology.free()


@pytest.mark.parametrize("text", ["zero", "0", "-1", "2.5"])
def test_bad_ranks_per_node_in_the_environment(monkeypatch, text):
    monkeypatch.setenv(ENV_RANKS_PER_NODE, text)
    with pytest.raises(ConfigError, match=ENV_RANKS_PER_NODE):
        Topology(MPI.COMM_SELF)


def test_ranks_per_node_from_the_environment(monkeypatch):
    monkeypatch.setenv(ENV_RANKS_PER_NODE, "4")
    topology = Topology(MPI.COMM_SELF)
    assert topology.emulated_ranks_per_node == 4 and topology.num_nodes == 1
    topology.free()


@settings(max_examples=80, deadline=None)  # the first call of each dtype compiles
@given(
    dtype=st.sampled_from(["float16", "bfloat16", "float32", "float64"]),
    n=st.integers(1, 300),
    bad=st.sampled_from([None, np.nan, np.inf, -np.inf]),
    data=st.data(),
)
def test_all_finite_finds_any_nan_or_inf(dtype, n, bad, data):
    from spar_comm.kernels import all_finite, copy_all_finite

    dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = (np.random.default_rng(n).standard_normal(n) * 1e3).astype(dtype)
    info = ml_dtypes.finfo(dtype)
    for extreme in (info.max, -info.max, info.smallest_subnormal, -0.0):  # finite, at the edges
        x[data.draw(st.integers(0, n - 1))] = extreme
    if bad is not None:
        x[data.draw(st.integers(0, n - 1))] = bad
    assert all_finite(x) == (bad is None) == bool(np.isfinite(x).all())
    copy = np.full_like(x, 7)
    assert copy_all_finite(copy, x) == (bad is None)  # the same verdict from the copy's own pass
    assert copy.tobytes() == x.tobytes()
    with pytest.raises(ValueError, match="alike arrays"):
        copy_all_finite(copy[1:], x)
    read_only = np.empty_like(x)
    read_only.flags.writeable = False
    for refused in [read_only] + ([np.empty(2 * n, dtype)[::2]] if n > 1 else []):  # strided: a copy written
        with pytest.raises(ValueError, match="contiguous, writable"):
            copy_all_finite(refused, x)
