"""``algorithm="auto"`` and ``values="auto"``: the allreducer and the value
codec the model predicts fastest, chosen alike on every rank.

What ``auto`` prices is a value, ``Pricing``: the machine figures and the
cluster's shape, identical on every rank. ``price`` makes it once for a job
(collective): the calibration named by ``SPAR_COMM_CALIBRATION``, read on
rank 0 alone, whose figures hold whatever crowding of cores it was measured
under; without one, the built-in CPU preset (this package's kernels select
on the host) with the link between nodes as ``probe.link`` times it and as
many cores as ``probe.shared_cores`` finds where ranks share them. A
checkpoint keeps it (``to_state``), so that a resumed run chooses as the run
it continues did (``from_state``). ``Pricing.choose`` is then a pure
function of the bucket: the allreducers below never see ``auto``.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

import numpy as np

from .. import collectives
from ..collectives import ALGORITHMS, AUTO, Allreducer, Settings
from ..collectives.checks import CODECS
from ..consensus import raise_if_any, require_same
from ..topology import Topology
from . import calibrate, fastest, predict, probe
from .machine import CPU, Cluster, Machine, beta_to_gbps, from_state

ENV_CALIBRATION = "SPAR_COMM_CALIBRATION"
#: What ``values="auto"`` chooses among: the sum's own values first, so that a
#: tie keeps them exact; then half precision and int8 blocks.
VALUE_CHOICES: Tuple[Optional[str], ...] = (None, "float16", "int8")


def chooses(algorithm: Any, values: Any) -> bool:
    """Whether the model has something to choose: the algorithm, the value codec, or both."""
    return algorithm == AUTO or values == AUTO


@dataclass(frozen=True)
class Pricing:
    """The figures and the cluster shape ``auto`` prices with."""

    machine: Machine
    cluster: Cluster
    #: What moves the bytes between nodes, as timed: "mpi", or "torch" (a torch.distributed group).
    transport: str = "mpi"

    def choose(self, size: Any, dtype: Any, density: Any, selector: Any, values: Optional[str] = None,
               indices: Optional[str] = None, among: Optional[Tuple[str, ...]] = None) -> str:
        """The fastest algorithm for a bucket: ``plan``'s, under ``auto``."""
        return self.plan(AUTO, size, dtype, density, selector, values, indices, among)[0]

    def plan(self, algorithm: str, size: Any, dtype: Any, density: Any, selector: Any,
             values: Optional[str] = None, indices: Optional[str] = None,
             among: Optional[Tuple[str, ...]] = None) -> Tuple[str, Optional[str]]:
        """The fastest (algorithm, value codec) for a bucket. ``algorithm``
        or, under ``auto``, any allreducer (of those named in ``among``, the
        ones a way in can use); ``values`` or, under ``auto``, any of
        ``VALUE_CHOICES`` the algorithm takes, each priced with ``indices``.
        Settings the allreducers would refuse get ``dense`` and the values
        given, whose constructor then raises the same ConfigError on every
        rank."""
        codecs = VALUE_CHOICES if values == AUTO else (values,)
        try:
            valid = int(size) >= 1 and 0 < float(density) <= 1 and selector in self.machine.select
            times: Dict[Tuple[str, Optional[str]], float] = {}
            for codec in codecs if valid else ():
                takes = [name for name in ([algorithm] if algorithm != AUTO else among or ALGORITHMS)
                         if (codec is None or name in CODECS["values"])
                         and (indices is None or name in CODECS["indices"])]
                times.update({(name, codec): t for name, t in predict(
                    self.cluster, int(size), self.machine, np.dtype(dtype).name, float(density), selector,
                    algorithms=takes, values=codec, indices=indices).items()} if takes else {})
            if times:
                return fastest(times)
        except (TypeError, ValueError, OverflowError, KeyError):
            pass
        return ("dense" if algorithm == AUTO else algorithm), (None if values == AUTO else values)

    def describe(self) -> str:
        """What is priced, in a few words."""
        over = "MPI" if self.transport == "mpi" else "torch.distributed"
        link = (f"{beta_to_gbps(self.machine.beta_inter):.3g} Gbit/s between nodes over {over}"
                if self.cluster.nodes > 1 else "one node")
        return link + (f", {self.cluster.ranks} ranks on {self.cluster.cores} cores" if self.cluster.cores else "")

    def to_state(self) -> Dict[str, Any]:
        """As JSON-able data, for a checkpoint."""
        return {"machine": self.machine.to_dict(), "cores": self.cluster.cores}


def resumed(topology: Topology, saved: Mapping[str, Any]) -> Pricing:
    """The pricing a checkpoint kept (``Pricing.to_state``), on ``topology``'s
    shape: a resumed run chooses as the run it continues did, whatever the
    link times now. Every rank must pass the same ``saved``."""
    machine, cores = from_state(saved)
    return Pricing(machine, _cluster(topology, cores), topology.transport)


def _cluster(topology: Topology, cores: Optional[int]) -> Cluster:
    return Cluster(topology.num_nodes, max(topology.node_sizes), cores)


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


def price(topology: Topology) -> Pricing:
    """What ``auto`` prices on ``topology``, identical on every rank
    (collective; without a calibration it times the link, so make it once a job)."""
    machine, calibrated = shared_machine(topology)
    cores = None
    if not calibrated:
        timed = probe.link(topology)
        if timed is not None:
            machine = machine.replace(alpha_inter=timed[0], beta_inter=timed[1])
        cores = probe.shared_cores(topology, topology.num_nodes * max(topology.node_sizes))
    return Pricing(machine, _cluster(topology, cores), topology.transport)


def choice(topology: Topology, pricing: Pricing, algorithm: str, size: Any, dtype: Any, density: Any,
           selector: Any, values: Optional[str] = None, indices: Optional[str] = None,
           among: Optional[Tuple[str, ...]] = None) -> Tuple[str, Optional[str]]:
    """``pricing.plan``, checked to be the same on every rank (collective):
    never two allreducers or codecs at once."""
    chosen = pricing.plan(algorithm, size, dtype, density, selector, values, indices, among)
    require_same(topology.world, "auto's choice", {"algorithm": chosen[0], "values": chosen[1]})
    return chosen


def make_allreducer(
    algorithm: str,
    topology: Topology,
    size: int,
    dtype: Any = "float32",
    density: float = 0.001,
    selector: str = "mstopk",
    error_feedback: bool = True,
    average: bool = True,
    selector_options: Optional[Dict[str, Any]] = None,
    shared_buffer: bool = False,
    values: Optional[str] = None,
    indices: Optional[str] = None,
    max_density: Optional[float] = None,
    *,
    pricing: Optional[Pricing] = None,
    **options: Any,
) -> Allreducer:
    """An allreducer of ``algorithm`` for flat gradients of ``size`` elements.

    Args:
        algorithm: one of ``spar_comm.ALGORITHMS``, or ``"auto"``: the one
            ``pricing`` predicts fastest (priced now when not given; pass the
            job's, to price once).
        topology: the ranks and how they sit on nodes.
        size, dtype: the flat gradient's (float32, float64, float16, bfloat16).
        density: the fraction selected; ``max_density`` (default ``density``)
            the most a call may ask for (``allreduce(density=)``).
        values, indices: the codecs of the messages (``codecs.VALUES``;
            ``values="auto"``: the fastest of ``VALUE_CHOICES`` as priced, the
            lossy ones included; ``indices="auto"`` picks int32, 16-bit gaps
            or a bitmap for each message, losing nothing).
        shared_buffer: ``.buffer`` in the node's shared memory where the
            algorithm reads it there.
        options: the algorithm's own (``powersgd``: ``rank``, ``shapes``).

    Returns:
        An ``Allreducer``; its settings are ``.settings``.

    Raises:
        ConfigError: on every rank, for a bad or disagreeing setting.

    Example:
        >>> reducer = make_allreducer("hitopk", Topology(MPI.COMM_WORLD), grad.size, density=0.01)
        >>> mean = reducer.allreduce(grad)

    Collective: every rank of ``topology.world`` calls it.
    """
    settings = Settings(density=density, selector=selector, error_feedback=error_feedback, average=average,
                        selector_options=dict(selector_options or {}), shared_buffer=shared_buffer, values=values,
                        indices=indices, max_density=max_density, options=options)
    return build_allreducer(algorithm, topology, size, dtype, settings, pricing)


def build_allreducer(algorithm: str, topology: Topology, size: int, dtype: Any, settings: Settings,
                     pricing: Optional[Pricing] = None, among: Optional[Tuple[str, ...]] = None) -> Allreducer:
    """``make_allreducer`` from a settings value: ``auto`` resolved by
    ``pricing`` (choosing ``among`` those named, where given), then
    ``collectives.build``. Collective."""
    raise_if_any(topology.world, collectives.unknown_algorithm(algorithm))
    require_same(topology.world, "allreducer settings", {"algorithm": algorithm, "values": settings.values})
    if chooses(algorithm, settings.values):
        pricing = pricing if pricing is not None else price(topology)
        algorithm, values = choice(topology, pricing, algorithm, size, dtype, settings.density, settings.selector,
                                   settings.values, settings.indices, among)
        settings = settings.replace(values=values)
    return collectives.build(algorithm, topology, size, dtype, settings)
