"""``algorithm="auto"`` under MPI: one choice on every rank, dense for small
buckets and sparse for large ones, and a bad calibration refused everywhere."""
from __future__ import annotations

import json

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all, assert_identical_bits
from spar_comm import ALGORITHMS, ConfigError, Topology, make_allreducer
from spar_comm.costmodel import GPU
from spar_comm.costmodel.auto import ENV_CALIBRATION

COMM = MPI.COMM_WORLD


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("size", [100, 5000, 3_000_000])
def test_auto_picks_one_algorithm_on_every_rank_and_reduces_like_it(topology, size):
    reducer = make_allreducer("auto", topology, size, density=0.01, selector="exact")
    names = COMM.allgather(reducer.name)
    assert len(set(names)) == 1 and names[0] in ALGORITHMS, names
    rng = np.random.default_rng([size, COMM.rank])
    grad = rng.integers(-64, 64, size).astype(np.float32)
    twin = make_allreducer(reducer.name, topology, size, density=0.01, selector="exact")
    out = reducer.allreduce(grad)
    assert_all(COMM, np.array_equal(out, twin.allreduce(grad)), "auto differs from the algorithm it chose")
    assert_identical_bits(COMM, out, "auto output")


@pytest.mark.mpi(min_size=2)
def test_small_buckets_stay_dense_and_large_go_sparse_with_a_slow_network(tmp_path_factory, monkeypatch):
    slow = GPU.with_links(inter_gbps=1, intra_gbps=1200)
    path = tmp_path_factory.mktemp("cal") / "slow.json" if COMM.rank == 0 else None
    if COMM.rank == 0:
        path.write_text(json.dumps({"tool": "spar_comm.costmodel", "machine": slow.to_dict()}))
    monkeypatch.setenv(ENV_CALIBRATION, str(COMM.bcast(path)))
    topo = Topology(ranks_per_node=1)
    small = make_allreducer("auto", topo, 64, density=0.001).name
    large = make_allreducer("auto", topo, 20_000_000, density=0.001).name
    assert_all(COMM, small in ("dense", "hier_dense"), f"small bucket went {small}")
    assert_all(COMM, large not in ("dense", "hier_dense"), f"large bucket went {large}")
    topo.free()


@pytest.mark.mpi(min_size=1)
def test_an_unreadable_calibration_is_refused_on_every_rank(monkeypatch):
    monkeypatch.setenv(ENV_CALIBRATION, "/no/such/calibration.json")
    topo = Topology(ranks_per_node=1)
    failed = False
    try:
        make_allreducer("auto", topo, 1000)
    except ConfigError as error:
        failed = "cannot read" in str(error)
    assert_all(COMM, failed, "no ConfigError naming the unreadable file")
    topo.free()


@pytest.mark.mpi(min_size=1)
def test_auto_with_bad_settings_raises_the_usual_config_error(topology):
    failed = False
    try:
        make_allreducer("auto", topology, 1000, density=1.5)
    except ConfigError as error:
        failed = "density" in str(error)
    assert_all(COMM, failed, "no ConfigError for density 1.5")
