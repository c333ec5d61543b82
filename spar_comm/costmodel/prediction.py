"""What the cost model predicts: the seconds of each allreducer's call, split
into its parts, and the fastest of them."""
from __future__ import annotations

from typing import Dict, Hashable, Iterable, Mapping, Optional, TypeVar

from ..collectives import ALGORITHMS
from ..collectives.checks import CODECS
from .algorithms import STEPS, step_terms
from .machine import Cluster, Machine

#: The parts of a step, by the prefix of the terms they sum.
PARTS = {"select": ("select",), "intra": ("alpha_intra", "beta_intra"),
         "inter": ("alpha_inter", "beta_inter", "host_inter"),
         "local": ("gamma", "pair", "overhead")}


def predict(cluster: Cluster, size: int, machine: Machine, dtype: str = "float32", density: float = 0.001,
            selector: str = "mstopk", algorithms: Optional[Iterable[str]] = None, values: Optional[str] = None,
            indices: Optional[str] = None) -> Dict[str, float]:
    """Predicted seconds per allreduce call of each algorithm (default: all; with
    ``values`` or ``indices``, all that take those codecs)."""
    if selector not in machine.select:
        raise ValueError(f"no selection figure for selector {selector!r}; known: {', '.join(sorted(machine.select))}")
    default = CODECS["indices"] if indices else CODECS["values"] if values else STEPS
    return {
        name: machine.seconds(step_terms(name, cluster, size, dtype, density, selector, values, indices))
        for name in (algorithms or default)
    }


def breakdown(algorithm: str, cluster: Cluster, size: int, machine: Machine, dtype: str = "float32",
              density: float = 0.001, selector: str = "mstopk", values: Optional[str] = None,
              indices: Optional[str] = None) -> Dict[str, float]:
    """Seconds of one call split into select, intra, inter and local work."""
    terms = step_terms(algorithm, cluster, size, dtype, density, selector, values, indices)
    return {
        part: machine.seconds({t: a for t, a in terms.items() if t.startswith(prefixes)})
        for part, prefixes in PARTS.items()
    }


Key = TypeVar("Key", bound=Hashable)


def fastest(times: Mapping[Key, float]) -> Key:
    """The key of least predicted time, an algorithm's name or an (algorithm,
    codec) pair; ties go to the one listed first. Only algorithms that return
    the sum compete (``adasum`` changes the update, so it is priced but never
    picked), unless none is listed."""
    def sums(key: Key) -> bool:
        name = key[0] if isinstance(key, tuple) else key
        return name not in ALGORITHMS or ALGORITHMS[name].sums

    summing = [key for key in times if sums(key)]
    return min(summing or times, key=lambda key: times[key])
