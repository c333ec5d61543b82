"""What the model knows about a machine and a cluster shape.

A ``Machine`` holds the alpha-beta-gamma figures: latency and inverse
bandwidth inside a node and across nodes, the cost of one local memory pass
per byte (reductions, copies, zero fills), the cost of one (index, value)
pair picked by a selector or scatter-added into a vector (``pair``: random
accesses, which at a density of 0.1 cost a CPU more than the passes over
the vector), the selection time of every top-k method (a fixed cost per
call, e.g. MSTopK's ~30 kernel launches or NumPy calls, plus a cost per
element scanned), and a fixed software overhead per allreduce call. A
``Cluster`` is the shape: nodes and ranks per node.

``beta_inter`` is the inverse bandwidth of a node's *network link*: flows
that leave a node at the same time share it (see ``mpi.py``). ``beta_intra``
is the inverse bandwidth one rank gets to another rank of its node.

An emulated cluster runs every rank on one machine's few cores (``Cluster``
with ``cores``): then the ranks' CPU work (memory passes, selection, message
handling, per-call overhead) is stretched by ``ranks / cores``, and every
byte between nodes also costs the shared CPU ``host_inter`` seconds in the
network stack. On a real cluster (``cores=None``) each rank has its own core
and a node's network stack works beside its link, so neither applies.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

#: The linear coefficients of the model, in the order of a fitted vector.
LINK_TERMS = ("overhead", "alpha_intra", "beta_intra", "alpha_inter", "beta_inter", "gamma", "pair", "host_inter")
#: Coefficients a calibration file may lack (written before they existed): 0.
OPTIONAL_TERMS = ("pair", "host_inter")


def gbps_to_beta(gbps: float) -> float:
    """Seconds per byte of a link of ``gbps`` Gbit/s."""
    return 8.0 / (gbps * 1e9)


def beta_to_gbps(beta: float) -> float:
    return 8.0 / (beta * 1e9) if beta > 0 else float("inf")


@dataclass(frozen=True)
class Cluster:
    """``nodes`` nodes of ``ranks_per_node`` ranks (one rank per GPU or process);
    ``cores``: the cores all ranks share when the cluster is emulated on one
    machine (None on a real cluster)."""

    nodes: int
    ranks_per_node: int
    cores: Optional[int] = None

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "cores"):
            value = getattr(self, name)
            if name == "cores" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def contention(self) -> float:
        """How many ranks share a core (at least 1): the stretch of their CPU work."""
        return max(1.0, self.ranks / self.cores) if self.cores else 1.0


@dataclass(frozen=True)
class Machine:
    """Alpha-beta-gamma figures in seconds, seconds per byte, seconds per element."""

    overhead: float
    alpha_intra: float
    beta_intra: float
    alpha_inter: float
    beta_inter: float
    gamma: float
    #: seconds per (index, value) pair picked by a selector or scatter-added
    pair: float = 0.0
    #: seconds of the shared CPU per byte between nodes (emulated clusters only)
    host_inter: float = 0.0
    #: selector name -> (seconds per call, seconds per element scanned)
    select: Mapping[str, Tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in LINK_TERMS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name, value in self.select.items():
            if len(value) != 2 or not all(isinstance(v, (int, float)) and 0 <= v < float("inf") for v in value):
                raise ValueError(f"selection figures of {name!r} must be two finite numbers >= 0, got {value!r}")

    def seconds(self, terms: Mapping[str, float]) -> float:
        """The time of ``terms`` (see ``mpi.py``): each amount times its figure."""
        total = 0.0
        for term, amount in terms.items():
            if term.startswith("select:"):
                total += amount * self.select[term[len("select:"):]][1]
            elif term.startswith("select_call:"):
                total += amount * self.select[term[len("select_call:"):]][0]
            else:
                total += amount * getattr(self, term)
        return total

    def replace(self, **changes) -> "Machine":
        return dataclasses.replace(self, **changes)

    def with_links(self, inter_gbps: float | None = None, intra_gbps: float | None = None) -> "Machine":
        """This machine with the given link speeds (None keeps a figure)."""
        changes = {}
        if inter_gbps is not None:
            changes["beta_inter"] = gbps_to_beta(inter_gbps)
        if intra_gbps is not None:
            changes["beta_intra"] = gbps_to_beta(intra_gbps)
        return self.replace(**changes)

    def to_dict(self) -> Dict[str, object]:
        select = {name: list(figures) for name, figures in self.select.items()}
        return {**{name: getattr(self, name) for name in LINK_TERMS}, "select": select}

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> "Machine":
        """Raises KeyError/TypeError/ValueError on a malformed mapping."""
        select = data["select"]
        if not isinstance(select, Mapping):
            raise TypeError("select must map a selector name to [seconds per call, seconds per element]")
        figures = {name: data.get(name, 0.0) if name in OPTIONAL_TERMS else data[name] for name in LINK_TERMS}
        return cls(**figures, select={k: tuple(v) for k, v in select.items()})


#: A GPU cluster as the predictions in docs/costmodel.md assume it: NVLink-class links
#: inside a node, a public-cloud network between nodes (the link speeds are
#: meant to be overridden), memory passes at HBM speed (read and write, ~1 TB/s), and selection rates of
#: GPU kernels (MSTopK: ~30 counting passes at ~1 TB/s; exact top-k by sort).
GPU = Machine(
    overhead=20e-6,
    alpha_intra=3e-6,
    beta_intra=gbps_to_beta(1200),
    alpha_inter=15e-6,
    beta_inter=gbps_to_beta(25),
    gamma=2e-12,
    select={"mstopk": (150e-6, 5e-11), "threshold": (100e-6, 5e-11), "threshold_warm": (100e-6, 3e-11),
            "exact": (50e-6, 4e-10)},
)

#: A CPU cluster running this package's NumPy kernels: shared memory inside a
#: node, 25 Gbit/s TCP between nodes, host selection rates of the order
#: bench_topk.py measures on one core, and a pair picked or scatter-added in
#: about 15 ns (``hitopk`` on 6.5M float32 over 2 x 2 ranks, 2 ranks to a
#: core, took 28.5 ms more at density 0.1 than at 0.001: 975,000 pairs more
#: a rank). The GPU preset leaves ``pair`` at 0: it was not measured there.
CPU = Machine(
    overhead=50e-6,
    alpha_intra=2e-6,
    beta_intra=gbps_to_beta(80),
    alpha_inter=30e-6,
    beta_inter=gbps_to_beta(25),
    gamma=2e-10,
    pair=1.5e-8,
    select={"mstopk": (100e-6, 4e-10), "threshold": (40e-6, 1.9e-10), "threshold_warm": (40e-6, 1.7e-10),
            "exact": (50e-6, 2e-9)},
)

PRESETS: Dict[str, Machine] = {"gpu": GPU, "cpu": CPU}


def from_state(saved: Mapping[str, Any]) -> Tuple[Machine, Optional[int]]:
    """The figures and cores of what ``auto.Pricing.to_state`` gave (a
    checkpoint's); KeyError, TypeError or ValueError on a malformed ``saved``."""
    cores = saved["cores"]
    if cores is not None and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ValueError(f"cores {cores!r}")
    return Machine.from_dict(saved["machine"]), cores
