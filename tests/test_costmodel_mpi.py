"""``algorithm="auto"`` under MPI: one choice on every rank, dense for small
buckets and sparse for large ones, one machine priced on every rank (the
link timed unless a calibration names it), and a bad calibration refused
everywhere."""
from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import assert_all, assert_identical_bits
from test_train_runs import datasets
from spar_comm import ALGORITHMS, ConfigError, SparCommError, Topology, collectives, make_allreducer
from spar_comm.costmodel import CPU, GPU, auto, gbps_to_beta, probe
from spar_comm.costmodel.auto import ENV_CALIBRATION
from spar_comm.training.config import TrainConfig
from spar_comm.training.loop import train

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
def test_the_allreducers_themselves_take_concrete_names_only(topology):
    with pytest.raises(ConfigError, match="algorithm='auto' is the cost model's choice.*spar_comm.make_allreducer"):
        collectives.build("auto", topology, 1000, "float32", collectives.Settings())


@pytest.mark.mpi(min_size=1)
def test_one_pricing_serves_every_choice_and_prices_nothing_again(topology, monkeypatch):
    """A job prices once and chooses from the value it holds: with it, no
    further timing, and the same choice as pricing anew would give."""
    monkeypatch.delenv(ENV_CALIBRATION, raising=False)
    pricing = auto.price(topology)

    def untimed(*args):
        raise AssertionError("timed again")

    monkeypatch.setattr(probe, "link", untimed)
    monkeypatch.setattr(probe, "shared_cores", untimed)
    for size in (64, 300_000):
        chosen = make_allreducer("auto", topology, size, density=0.001, pricing=pricing).name
        assert_all(COMM, chosen == pricing.choose(size, "float32", 0.001, "mstopk"), f"{size}: chose {chosen}")


@pytest.mark.mpi(min_size=2)
def test_auto_values_build_the_codec_priced_fastest_alike_on_every_rank(topology):
    """``values="auto"``: int8 over a slow link, the sum's own values over a
    fast one (or within a node), and the built allreducer reduces as one made
    with that codec by name."""
    size, chosen = 300_000, []
    for i, gbps in enumerate((0.1, 400)):
        pricing = auto.resumed(topology, {"machine": CPU.replace(beta_inter=gbps_to_beta(gbps)).to_dict(),
                                          "cores": None})
        reducer = make_allreducer("hitopk", topology, size, density=0.01, values="auto", pricing=pricing)
        values = reducer.settings.values
        assert_all(COMM, (reducer.name, values) == pricing.plan("hitopk", size, "float32", 0.01, "mstopk", "auto"),
                   f"{gbps} Gbit/s: built {values}")
        assert_all(COMM, len(set(COMM.allgather(values))) == 1, "ranks chose different codecs")
        grad = np.random.default_rng([i, COMM.rank]).standard_normal(size).astype(np.float32)
        twin = make_allreducer("hitopk", topology, size, density=0.01, values=values)
        assert_all(COMM, np.array_equal(reducer.allreduce(grad), twin.allreduce(grad)), "differs from its codec")
        chosen.append(values)
    crosses = topology.num_nodes > 1
    assert_all(COMM, chosen == (["int8", None] if crosses else [None, None]), f"chose {chosen}")


@pytest.mark.mpi(min_size=1)
def test_auto_with_bad_settings_raises_the_usual_config_error(topology):
    failed = False
    try:
        make_allreducer("auto", topology, 1000, density=1.5)
    except ConfigError as error:
        failed = "density" in str(error)
    assert_all(COMM, failed, "no ConfigError for density 1.5")


@pytest.mark.openmpi
@pytest.mark.mpi(min_size=1)
def test_auto_prices_one_machine_on_every_rank_with_the_link_it_timed(topology, monkeypatch):
    """Without a calibration: the preset, with the link between nodes as the
    probe timed it (shared memory here: positive and finite, and not the
    preset's 25 Gbit/s to the last bit) and the preset's kept on one node;
    identical on every rank, a value that goes through its state unchanged."""
    monkeypatch.delenv(ENV_CALIBRATION, raising=False)
    fresh = Topology(ranks_per_node=topology.emulated_ranks_per_node)
    pricing = auto.price(fresh)
    machine, cluster = pricing.machine, pricing.cluster
    assert auto.resumed(fresh, json.loads(json.dumps(pricing.to_state()))) == pricing
    assert_all(COMM, (cluster.nodes, cluster.ranks_per_node) == (fresh.num_nodes, max(fresh.node_sizes)),
               f"shape {cluster}")
    figures = json.dumps(machine.to_dict(), sort_keys=True)
    assert_all(COMM, len(set(COMM.allgather((figures, cluster)))) == 1, "ranks price different machines")
    timed = (machine.alpha_inter, machine.beta_inter)
    if fresh.num_nodes == 1:
        assert_all(COMM, timed == (CPU.alpha_inter, CPU.beta_inter), f"one node, yet {timed}")
    else:
        assert_all(COMM, 0 < machine.alpha_inter < 0.1 and 0 < machine.beta_inter < 1e-6
                   and machine.beta_inter != CPU.beta_inter, f"the probe timed {timed}")
    fresh.free()


@pytest.mark.mpi(min_size=2)
def test_a_failed_timing_raises_the_same_error_on_every_rank(monkeypatch):
    monkeypatch.delenv(ENV_CALIBRATION, raising=False)

    def broken(round_trip):
        round_trip(8)
        raise OSError("injected")

    monkeypatch.setattr(probe, "time_link", broken)  # called on world rank 0 alone
    topo = Topology(ranks_per_node=1)
    failed = False
    try:
        make_allreducer("auto", topo, 1000)
    except SparCommError as error:
        failed = "timing the link between nodes" in str(error) and "injected" in str(error)
    assert_all(COMM, failed, "no SparCommError naming the failed timing")
    reducer = make_allreducer("dense", topo, 1000)  # and the ranks still talk
    assert_all(COMM, np.array_equal(reducer.allreduce(np.ones(1000, np.float32)), np.ones(1000)),  # the mean
               "the next allreduce is wrong")
    topo.free()


@pytest.mark.mpi(min_size=2)
def test_a_calibration_names_the_link_and_nothing_is_timed(tmp_path_factory, monkeypatch):
    slow = CPU.with_links(inter_gbps=0.5)
    path = tmp_path_factory.mktemp("cal") / "half.json" if COMM.rank == 0 else None
    if COMM.rank == 0:
        path.write_text(json.dumps({"tool": "spar_comm.costmodel", "machine": slow.to_dict()}))
    monkeypatch.setenv(ENV_CALIBRATION, str(COMM.bcast(path)))

    def untimed(*args):
        raise AssertionError("timed despite a calibration")

    monkeypatch.setattr(probe, "link", untimed)
    monkeypatch.setattr(probe, "shared_cores", untimed)
    topo = Topology(ranks_per_node=1)
    pricing = auto.price(topo)
    machine, cluster = pricing.machine, pricing.cluster
    assert_all(COMM, machine == slow and cluster.cores is None, f"priced {machine}, {cluster}")
    topo.free()


@pytest.mark.mpi(min_size=2)
def test_a_resumed_auto_run_chooses_as_the_run_it_resumes(tmp_path_factory, monkeypatch):
    """The link timed at 10 Mbit/s when the run started and at 1 Tbit/s when
    it resumed, where auto would choose otherwise: the resumed run prices the
    figures its checkpoint saved and ends on the bits of the run never stopped."""
    monkeypatch.delenv(ENV_CALIBRATION, raising=False)
    folder = COMM.bcast(str(tmp_path_factory.mktemp("auto")) if COMM.rank == 0 else None)

    def timed(gbps):  # a slow link's latency with a slow link, a fast one's with a fast one
        monkeypatch.setattr(probe, "time_link", lambda round_trip: (1e-4 if gbps < 1 else 1e-6, gbps_to_beta(gbps)))

    common = dict(algorithm="auto", ranks_per_node=1, steps=20, hidden=32, selector="exact", density=0.05,
                  density_schedule="fixed", trace=None, progress=False)
    timed(0.01)
    train(TrainConfig(checkpoint=f"{folder}/full.h5", **common), COMM)
    train(TrainConfig(checkpoint=f"{folder}/part.h5", stop_after=10, **common), COMM)
    size = sum(v.size for name, v in datasets(f"{folder}/full.h5").items() if name.startswith("params/"))
    choices = []
    for gbps in (0.01, 1000):
        timed(gbps)
        topo = Topology(ranks_per_node=1)
        choices.append(make_allreducer("auto", topo, size, density=0.05, selector="exact").name)
        topo.free()
    assert_all(COMM, choices[0] != choices[1], f"auto chose {choices} at both links: the test shows nothing")
    train(TrainConfig(checkpoint=f"{folder}/part.h5", resume=True, **common), COMM)
    same = True
    if COMM.rank == 0:
        full, part = datasets(f"{folder}/full.h5"), datasets(f"{folder}/part.h5")
        same = sorted(full) == sorted(part) and all(np.array_equal(full[n], part[n]) for n in full)
        with h5py.File(f"{folder}/full.h5", "r") as a, h5py.File(f"{folder}/part.h5", "r") as b:
            same = same and a.attrs["auto_priced"] == b.attrs["auto_priced"]  # the 10 Mbit/s, kept through the resume
    assert_all(COMM, COMM.bcast(same), "the resumed run differs from the run never stopped")
