"""``algorithm="auto"``: the allreducer the model predicts fastest, chosen alike on every rank.

The choice is a pure function of the cluster's shape, the size, dtype,
density, selector and the machine figures. Every rank holds the size, dtype,
density and selector identically (make_allreducer checks them across ranks);
the shape and the figures are made once per topology and broadcast
(``priced``): the calibration named by ``SPAR_COMM_CALIBRATION``, read on
rank 0 alone, whose figures hold whatever crowding of cores it was measured
under; without one, the built-in CPU preset (this package's kernels select
on the host) with the link between nodes as ``probe.link`` times it and as
many cores as ``probe.shared_cores`` finds where ranks share them.
"""
from __future__ import annotations

import os
import weakref
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from ..consensus import raise_if_any
from ..topology import Topology
from . import calibrate, fastest, predict, probe
from .machine import CPU, Cluster, Machine, beta_to_gbps

ENV_CALIBRATION = "SPAR_COMM_CALIBRATION"

#: topology -> what ``priced`` found for it. Every rank makes and drops a
#: topology together, so every rank finds or misses it alike.
_PRICED: "weakref.WeakKeyDictionary[Topology, Tuple[Machine, Cluster]]" = weakref.WeakKeyDictionary()


def shared_machine(topology: Topology) -> Tuple[Machine, bool]:
    """The machine figures, identical on every rank, and whether a calibration
    gave them (collective). Selectors a calibration lacks keep the preset's
    figures (a gTop-k merge is priced with ``exact``)."""
    figures, path, problem = None, "", None
    if topology.world.rank == 0:
        path = os.environ.get(ENV_CALIBRATION, "").strip()
        try:
            machine = calibrate.load([path], base=CPU) if path else CPU
            figures = machine.replace(select={**CPU.select, **machine.select}).to_dict()
        except calibrate.CalibrationError as error:
            problem = f"{ENV_CALIBRATION}: {error}"
    raise_if_any(topology.world, problem)
    figures, calibrated = topology.world.bcast((figures, bool(path)), root=0)
    return Machine.from_dict(figures), calibrated


def priced(topology: Topology) -> Tuple[Machine, Cluster]:
    """The figures and the shape ``auto`` prices for ``topology``, identical
    on every rank (collective; measured on the first call for a topology)."""
    known = _PRICED.get(topology)
    if known is None:
        machine, calibrated = shared_machine(topology)
        nodes, per_node = topology.num_nodes, max(topology.node_sizes)
        cores = None
        if not calibrated:
            timed = probe.link(topology)
            if timed is not None:
                machine = machine.replace(alpha_inter=timed[0], beta_inter=timed[1])
            cores = probe.shared_cores(topology, nodes * per_node)
        cluster = Cluster(nodes, per_node, cores)
        known = _PRICED[topology] = (machine, cluster)
    return known


def state(topology: Topology) -> Dict[str, Any]:
    """What ``priced`` holds for ``topology``, as JSON-able data for a
    checkpoint (collective on a topology's first call, as ``priced``)."""
    machine, cluster = priced(topology)
    return {"machine": machine.to_dict(), "cores": cluster.cores}


def from_state(saved: Mapping[str, Any]) -> Tuple[Machine, Optional[int]]:
    """The figures and cores that ``state`` gave; KeyError, TypeError or
    ValueError on a malformed ``saved``."""
    cores = saved["cores"]
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ValueError(f"cores {cores!r}")
    return Machine.from_dict(saved["machine"]), cores


def adopt(topology: Topology, saved: Mapping[str, Any]) -> None:
    """Price ``topology`` as ``state`` gave, so that a resumed run chooses as
    the run it resumes did, whatever the link times now. Every rank must pass
    the same ``saved`` (checked by ``from_state``), before ``auto`` first
    prices ``topology``."""
    machine, cores = from_state(saved)
    _PRICED[topology] = (machine, Cluster(topology.num_nodes, max(topology.node_sizes), cores))


def describe(topology: Topology) -> str:
    """What ``auto`` prices for ``topology``, in a few words (collective on a
    topology's first call, as ``priced``)."""
    machine, cluster = priced(topology)
    link = f"{beta_to_gbps(machine.beta_inter):.3g} Gbit/s between nodes" if cluster.nodes > 1 else "one node"
    return link + (f", {cluster.ranks} ranks on {cluster.cores} cores" if cluster.cores else "")


def choose(topology: Topology, size: Any, dtype: Any, density: Any, selector: Any,
           values: Optional[str] = None, indices: Optional[str] = None) -> str:
    """The fastest algorithm for this topology and bucket (collective); with
    codecs (``values``, ``indices``), the fastest of those that take them.

    Settings the allreducers would refuse get ``dense``, whose constructor
    then raises the same ConfigError on every rank.
    """
    machine, cluster = priced(topology)
    try:
        valid = int(size) >= 1 and 0 < float(density) <= 1 and selector in machine.select
        if valid:
            return fastest(predict(cluster, int(size), machine, np.dtype(dtype).name, float(density), selector,
                                   values=values, indices=indices))
    except (TypeError, ValueError, OverflowError):
        pass
    return "dense"
