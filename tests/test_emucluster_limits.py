"""What limits the emulated cluster on a machine, and the refusal beyond it:
memory per rank, open files, and the host addresses of a prefix."""
from __future__ import annotations

import pytest

from spar_comm import emucluster

pytestmark = pytest.mark.alone  # it shapes an emulated network

needs_netns = pytest.mark.skipif(emucluster.available() is not None, reason="no emulated cluster here")


def test_memory_beyond_the_machine_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(emucluster, "MEMORY_PER_RANK", 2**50)
    problem = emucluster.capacity_problem(emucluster.ClusterSpec(2, 1, prefix="spu"))
    assert "2 ranks need about" in problem and "GiB of memory" in problem and "at most 0 ranks" in problem


def test_open_files_beyond_the_limit_are_refused_naming_it(monkeypatch):
    monkeypatch.setattr(emucluster.resource, "getrlimit", lambda what: (70, 70))
    problem = emucluster.capacity_problem(emucluster.ClusterSpec(4, 2, prefix="spu"))
    assert "open-file limit of 70 (ulimit -n)" in problem


def test_more_hosts_than_addresses_are_refused_naming_the_subnet():
    with pytest.raises(ValueError, match=r"hosts must be in 1\.\.244 .*/24 subnet"):
        emucluster.ClusterSpec(emucluster.MAX_HOSTS + 1, 1, prefix="spu")


@needs_netns
def test_up_beyond_the_limit_makes_nothing(monkeypatch):
    monkeypatch.setattr(emucluster, "MEMORY_PER_RANK", 2**50)
    with pytest.raises(emucluster.EmuClusterError, match="cannot host 16 x 2 ranks here: 32 ranks need"):
        emucluster.up(emucluster.ClusterSpec(16, 2, prefix="spu"))
    assert not emucluster.existing("spu")
