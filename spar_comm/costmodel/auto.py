"""``algorithm="auto"``: the allreducer the model predicts fastest, chosen alike on every rank.

The choice is a pure function of the topology's shape, the size, dtype,
density, selector and the machine figures. Every rank holds the first four
identically (make_allreducer checks them across ranks); the figures are the
built-in CPU preset (this package's kernels select on the host), or the
calibration named by ``SPAR_COMM_CALIBRATION``, read on rank 0 alone and
broadcast, so that every rank prices the same machine.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np

from ..consensus import raise_if_any
from ..topology import Topology
from . import calibrate, fastest, predict
from .machine import CPU, Cluster, Machine

ENV_CALIBRATION = "SPAR_COMM_CALIBRATION"


def shared_machine(topology: Topology) -> Machine:
    """The machine figures, identical on every rank (collective)."""
    figures, problem = None, None
    if topology.world.rank == 0:
        path = os.environ.get(ENV_CALIBRATION, "").strip()
        try:
            figures = (calibrate.load([path], base=CPU) if path else CPU).to_dict()
        except calibrate.CalibrationError as error:
            problem = f"{ENV_CALIBRATION}: {error}"
    raise_if_any(topology.world, problem)
    return Machine.from_dict(topology.world.bcast(figures, root=0))


def choose(topology: Topology, size: Any, dtype: Any, density: Any, selector: Any,
           machine: Optional[Machine] = None, values: Optional[str] = None, indices: Optional[str] = None) -> str:
    """The fastest algorithm for this topology and bucket (collective); with
    codecs (``values``, ``indices``), the fastest of those that take them.

    Settings the allreducers would refuse get ``dense``, whose constructor
    then raises the same ConfigError on every rank.
    """
    machine = shared_machine(topology) if machine is None else machine
    try:
        valid = int(size) >= 1 and 0 < float(density) <= 1 and selector in machine.select
        cluster = Cluster(topology.num_nodes, max(topology.node_sizes))
        if valid:
            return fastest(predict(cluster, int(size), machine, np.dtype(dtype).name, float(density), selector,
                                   values=values, indices=indices))
    except (TypeError, ValueError, OverflowError):
        pass
    return "dense"
