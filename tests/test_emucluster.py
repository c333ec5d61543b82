"""The emulated cluster, where this machine allows it (root, network
namespaces, MPICH's launcher); skipped cleanly elsewhere."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from mpi4py import MPI

from conftest import ROOT, emulated_cluster, emulated_cluster_unavailable
from spar_comm import emucluster


REASON = emulated_cluster_unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated cluster here: {REASON}")
pytestmark = pytest.mark.alone  # it shapes an emulated network and times what crosses it
PREFIX = "spt"  # not the default, so a user's own cluster is never touched


@pytest.fixture
def cluster():
    with emulated_cluster(2, 2, PREFIX) as spec:
        yield spec
    assert not emucluster.existing(PREFIX)


@pytest.mark.slow
@needs_netns
def test_inter_host_bytes_cross_the_shaped_links(cluster):
    """hier_dense at 2 hosts x 2 ranks: the rail Allreduce between two ranks is
    the only traffic between hosts, and what .last counts for it must match what
    the interfaces counted within 10% (TCP/IP headers and acknowledgements)."""
    size, calls = 1 << 20, 4
    before = emucluster.link_counters(cluster)
    probe = [sys.executable, str(ROOT / "tests" / "emu_bytes_probe.py"), "hier_dense", str(size), str(calls)]
    result = emucluster.run(cluster, probe, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    after = emucluster.link_counters(cluster)
    sent = sum(a["tx_bytes"] - b["tx_bytes"] for a, b in zip(after, before))
    assert report["num_nodes"] == 2 and len(report["hosts"]) == 2, report
    assert report["bytes_inter"] == calls * 4 * size * 4 // 2  # 4 ranks, each half of its shard twice
    print(f"interfaces sent {sent:,} B; .last counted {report['bytes_inter']:,} B")
    assert abs(sent - report["bytes_inter"]) <= 0.10 * report["bytes_inter"], (sent, report)


PRICED_LINK = """
import os
from spar_comm import Topology
from spar_comm.costmodel import auto
os.environ.pop(auto.ENV_CALIBRATION, None)
topology = Topology()  # no emulation: the hosts are found by shared memory
pricing = auto.price(topology)
if topology.world.rank == 0:
    print(8 / pricing.machine.beta_inter / 1e9, pricing.machine.alpha_inter, pricing.cluster.cores)
"""


@pytest.mark.slow
@needs_netns
@pytest.mark.parametrize("rate, gbps", [("1gbit", 1.0), ("100mbit", 0.1)])
def test_auto_times_the_shaped_link(cluster, rate, gbps):
    """Without a calibration ``auto`` prices the link the probe timed: within
    30% of the shaped rate (the token bucket lets a burst through at once),
    and four ranks on this machine's cores counted as such."""
    emucluster.reshape(cluster, rate, "0us")
    result = emucluster.run(cluster, [sys.executable, "-c", PRICED_LINK], timeout=120)
    assert result.returncode == 0, result.stderr
    timed, alpha, cores = result.stdout.split()[-3:]
    print(f"{rate}: timed {float(timed):.3f} Gbit/s, latency {float(alpha) * 1e6:.0f} us, cores {cores}")
    assert 0.7 * gbps <= float(timed) <= 1.3 * gbps and 0 < float(alpha) < 0.01
    expected = len(os.sched_getaffinity(0))
    assert cores == (str(expected) if expected < 4 else "None")


@needs_netns
def test_links_are_shaped_and_reshaped(cluster):
    qdiscs = subprocess.run(["ip", "netns", "exec", cluster.namespace(0), "tc", "qdisc", "show", "dev",
                             emucluster.IFACE], capture_output=True, text=True).stdout
    assert "tbf" in qdiscs and "rate 1Gbit" in qdiscs
    spec = emucluster.reshape(cluster, "100mbit", "0us")
    qdiscs = subprocess.run(["tc", "qdisc", "show", "dev", spec.veth(1)], capture_output=True, text=True).stdout
    assert "rate 100Mbit" in qdiscs


@needs_netns
def test_unshaped_links_have_no_rate_limit(cluster):
    spec = emucluster.reshape(cluster, emucluster.UNSHAPED, "0us")
    for where in (["ip", "netns", "exec", spec.namespace(0), "tc", "qdisc", "show", "dev", emucluster.IFACE],
                  ["tc", "qdisc", "show", "dev", spec.veth(0)]):
        assert "tbf" not in subprocess.run(where, capture_output=True, text=True).stdout
    assert emucluster.rate_bits_per_second(emucluster.UNSHAPED) == float("inf")


@pytest.mark.slow
@needs_netns
def test_bench_comm_counts_each_algorithms_bytes_on_the_links(cluster, tmp_path):
    """bench_comm.py --link-counters: what every host's interface sent in one
    call of each algorithm, against the package's own count. hier_dense's
    inter-node traffic is its rail Allreduce alone: within 10%. dense and
    topka talk on the world communicator, where the package counts every byte
    as if it crossed nodes; MPICH's butterflies cross only at distance 2:
    Rabenseifner's allreduce puts a quarter of the vector each way per rank on
    the links (2 x nbytes in all), recursive doubling's allgather 2 of the 3
    blocks the package counts."""
    out = tmp_path / "bench.json"
    command = [sys.executable, str(ROOT / "drivers" / "bench_comm.py"), "--sizes", str(1 << 20), "--repeat", "1",
               "--warmup", "1", "--algorithms", "dense,hier_dense,topka", "--link-counters", emucluster.IFACE,
               "--out", str(out)]
    result = emucluster.run(cluster, command, timeout=180)
    assert result.returncode == 0, result.stderr
    rows = {row["algorithm"]: row for row in json.loads(out.read_text())["results"]}
    links = {algorithm: (row["link_bytes"], row["bytes_inter_all_ranks"]) for algorithm, row in rows.items()}
    sent, counted = links["hier_dense"]
    assert counted > 0 and abs(sent - counted) <= 0.10 * counted, links
    expected = {"dense": 2 * rows["dense"]["nbytes"], "topka": 2 / 3 * links["topka"][1]}
    for algorithm, nbytes in expected.items():
        assert abs(links[algorithm][0] - nbytes) <= 0.10 * nbytes, links


@needs_netns
def test_a_failed_up_leaves_nothing_behind(monkeypatch):
    emucluster.down(PREFIX)

    def broken(spec, i, verb="add"):
        raise emucluster.EmuClusterError("injected failure")

    monkeypatch.setattr(emucluster, "_shape", broken)
    with pytest.raises(emucluster.EmuClusterError, match="injected"):
        emucluster.up(emucluster.ClusterSpec(2, 1, "1gbit", "0us", PREFIX))
    assert not emucluster.existing(PREFIX)


def test_refuses_without_root(monkeypatch):
    monkeypatch.setattr(emucluster.os, "geteuid", lambda: 1000)
    with pytest.raises(emucluster.EmuClusterError, match="needs root"):
        emucluster.up(emucluster.ClusterSpec(2, 1))


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(hosts=0, ranks_per_host=1), "hosts must be"),
        (dict(hosts=2, ranks_per_host=0), "ranks per host"),
        (dict(hosts=2, ranks_per_host=1, rate="fast"), "not a tc rate"),
        (dict(hosts=2, ranks_per_host=1, delay="5"), "not a tc time"),
        (dict(hosts=2, ranks_per_host=1, prefix="Bad-Name"), "prefix"),
    ],
)
def test_bad_specs(settings, words):
    with pytest.raises(ValueError, match=words):
        emucluster.ClusterSpec(**settings)


@pytest.mark.slow
def test_driver_reports_bad_input_with_status_2(run_driver):
    result = run_driver("emucluster.py", "up", "--hosts", "0")
    assert result.returncode == 2 and "hosts must be" in result.stderr
    result = run_driver("emucluster.py", "run")
    assert result.returncode == 2 and "run needs a command" in result.stderr


@pytest.mark.openmpi
def test_only_mpichs_launcher_is_taken(tmp_path):
    """The launch script is Hydra's (-launcher-exec): Open MPI's launcher is
    refused by name, and so is the one beside this Python unless MPI is MPICH."""
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'mpiexec (Open MPI) 5.0.11'\n")
    fake.chmod(0o755)
    with pytest.raises(emucluster.EmuClusterError, match=r"needs MPICH's mpiexec \(Hydra\), and .* is Open MPI's"):
        emucluster.require_hydra(str(fake))
    with pytest.raises(emucluster.EmuClusterError, match="cannot run the MPI launcher"):
        emucluster.require_hydra(str(tmp_path / "missing"))
    beside = emucluster.default_mpiexec()
    assert os.path.dirname(beside) == os.path.dirname(sys.executable)
    if MPI.get_vendor()[0] == "MPICH":
        emucluster.require_hydra(beside)
    else:
        with pytest.raises(emucluster.EmuClusterError, match="needs MPICH's mpiexec"):
            emucluster.require_hydra(beside)
