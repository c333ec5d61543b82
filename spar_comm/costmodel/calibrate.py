"""Machine figures from this package's own measurements.

Three kinds of JSON file are understood:

* ``bench_comm.py`` output: every algorithm timed at several sizes on one
  cluster shape. Selection time per element comes from the measured
  ``t_select`` (in context: caches and rank contention as in a real step),
  as a line through the times per call against the elements scanned;
  the remaining link and memory figures are fitted to ``time_median`` minus
  the selection, by non-negative least squares on relative errors, so that
  small and large sizes weigh alike. Repeated runs of one setting are pooled
  by their median. ``t_select`` already holds the time of the pairs picked,
  which the model also counts in ``pair``: the fitted ``pair`` is what the
  scatter-adds cost spread over both counts, which holds at the density
  measured and only roughly at others.
* ``bench_topk.py`` output: selection time of every selector, per call and
  per element (a line through its times at the sizes measured), for
  selectors ``bench_comm`` did not run.
* a calibration written by ``save`` (``predict.py fit``): the figures as is.

A figure the files cannot determine (say inter-node terms from a one-node
run) keeps the value of the ``base`` machine.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from statistics import median
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..collectives.checks import CODECS
from ..files import BadFileError, check, read_json, write_json
from ..kernels import SELECTORS
from .algorithms import STEPS, step_terms
from .machine import CPU, LINK_TERMS, OPTIONAL_TERMS, Cluster, Machine

TOOL = "spar_comm.costmodel"
#: Rounds of reweighting by the predicted time (see ``fit``).
REWEIGHTS = 8


#: Version of the calibration files ``save`` writes; files without one are of version 1.
FORMAT = 1
#: What each kind of input must hold (spar_comm.files.check); other keys are ignored.
MACHINE = {**{name: float for name in LINK_TERMS if name not in OPTIONAL_TERMS}, "select": {str: (float, float)}}
BENCH_COMM = {
    "meta": {"num_nodes": int, "ranks_per_node": int, "dtype": str, "density": float, "selector": str},
    "results": [{"algorithm": str, "size": int, "time_median": float, "t_select": float}],
}
BENCH_TOPK = {"machine": dict, "records": [{"method": str, "n": int, "median_s": float}]}


#: What a benchmark can have measured: times of a nanosecond to days (beyond,
#: the fit's weights overflow), sizes below 2**48 elements, clusters below 2**20.
SECONDS = (1e-9, 1e6)
LARGEST_SIZE, LARGEST_CLUSTER = 1 << 48, 1 << 20


def measurable(seconds: float, zero: bool = False) -> bool:
    """Whether ``seconds`` is a time a benchmark can have measured (or 0, where ``zero``)."""
    return (zero and seconds == 0) or SECONDS[0] <= seconds <= SECONDS[1]


class CalibrationError(BadFileError):
    """A calibration input that cannot be used: unreadable, foreign, malformed or empty."""


@dataclass(frozen=True)
class Measurement:
    """One bench_comm row: an algorithm's median step time on a cluster shape."""

    cluster: Cluster
    algorithm: str
    size: int
    dtype: str
    density: float
    selector: str
    seconds: float
    select_seconds: float
    values: Optional[str] = None  # the codecs bench_comm ran with (topka, hitopk, hitopk_leader)
    indices: Optional[str] = None

    def terms(self):
        return step_terms(self.algorithm, self.cluster, self.size, self.dtype, self.density, self.selector,
                          self.values, self.indices)


def read(path: str) -> Tuple[str, dict]:
    """(kind, document) of a calibration input; kind is bench_comm, bench_topk or
    calibration. Only the kind is decided here; ``measurements``, ``topk_rates``
    and ``machine_of`` check the contents."""
    try:
        document = read_json(path)
    except BadFileError as error:
        raise CalibrationError(path, error.problem) from None
    if isinstance(document, dict):
        if document.get("tool") == TOOL:
            return "calibration", document
        if "meta" in document and "results" in document:
            return "bench_comm", document
        if "machine" in document and "records" in document:
            return "bench_topk", document
    raise CalibrationError(path, "neither bench_comm.py nor bench_topk.py output nor a calibration from 'predict.py fit'")


def checked(document: dict, schema: dict, path: str, kind: str) -> dict:
    """``document`` if it matches ``schema``; else CalibrationError naming the kind and the key."""
    try:
        return check(document, schema, path)
    except BadFileError as error:
        raise CalibrationError(path, f"malformed {kind} ({error.problem})") from None


def machine_of(document: dict, path: str) -> Machine:
    """The figures of a calibration written by ``save``."""
    version = document.get("format", 1)
    if version != FORMAT:
        raise CalibrationError(path, f"calibration format {version!r}; this version of spar_comm reads format {FORMAT}")
    figures = checked(document, {"machine": MACHINE}, path, "calibration")["machine"]
    try:
        return Machine.from_dict(figures)
    except ValueError as error:  # the Machine's own checks, e.g. a negative cost
        raise CalibrationError(path, f"malformed calibration ({error})") from None


def measurements(document: dict, path: str = "bench_comm JSON") -> List[Measurement]:
    """The rows of a bench_comm document, checked."""
    checked(document, BENCH_COMM, path, "bench_comm JSON")
    meta = document["meta"]
    nodes, per_node = meta["num_nodes"], meta["ranks_per_node"]
    if not (1 <= nodes < LARGEST_CLUSTER and 1 <= per_node < LARGEST_CLUSTER):
        raise CalibrationError(path, f"meta: {nodes} nodes of {per_node} ranks")
    checked(meta.get("node_sizes", []), [int], path, "bench_comm JSON's meta.node_sizes")
    if len(set(meta.get("node_sizes", [per_node]))) != 1:
        raise CalibrationError(path, "nodes of unequal size cannot be fitted")
    rows = [
        Measurement(Cluster(nodes, per_node), r["algorithm"], r["size"], meta["dtype"], float(meta["density"]),
                    meta["selector"], float(r["time_median"]), float(r["t_select"]),
                    *(meta.get(setting) if r["algorithm"] in CODECS[setting] else None
                      for setting in ("values", "indices")))
        for r in document["results"]
    ]
    for i, row in enumerate(rows):
        if (row.algorithm not in STEPS or row.selector not in SELECTORS or not 1 <= row.size < LARGEST_SIZE
                or not measurable(row.seconds) or not measurable(row.select_seconds, zero=True)
                or row.dtype not in ("float32", "float64") or not 0 < row.density <= 1):
            raise CalibrationError(path, f"results[{i}] is a row the model does not know: {row}")
    return rows


def selection_line(samples: Sequence[Tuple[float, float]]) -> Tuple[float, float]:
    """(seconds per call, seconds per element) through (elements, seconds)
    samples; with a single size measured, all of it is per element."""
    elements = np.array([e for e, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    if len(set(elements)) < 2:
        return 0.0, float(np.median(seconds / elements))
    scale = np.array([1.0, elements.max()])
    per_call, per_element = nonnegative_lstsq(np.column_stack([np.ones_like(elements), elements]) / scale, seconds) / scale
    return float(per_call), float(per_element)


def topk_rates(document: dict, path: str = "bench_topk JSON") -> Dict[str, Tuple[float, float]]:
    """Selection figures of every selector in a bench_topk document."""
    samples: Dict[str, List[Tuple[float, float]]] = {}
    for i, record in enumerate(checked(document, BENCH_TOPK, path, "bench_topk JSON")["records"]):
        if not (1 <= record["n"] < LARGEST_SIZE and measurable(record["median_s"])):
            raise CalibrationError(path, f"records[{i}] is not a measurement: {record}")
        if record["method"] in SELECTORS:
            samples.setdefault(record["method"], []).append((record["n"], float(record["median_s"])))
    if not samples:
        raise CalibrationError(path, "no records of a known selector")
    return {method: selection_line(points) for method, points in samples.items()}


def in_context_rates(rows: Sequence[Measurement]) -> Dict[str, Tuple[float, float]]:
    """Selection figures from bench_comm's t_select. gtopk is left out: its
    t_select also holds the merges up the tree; so is hitopk on nodes of
    more than one rank, whose t_select also holds the node's sum (the
    candidate pass rides on it)."""
    samples: Dict[str, List[Tuple[float, float]]] = {}
    for row in rows:
        node_sum = row.algorithm == "hitopk" and row.cluster.ranks_per_node > 1
        if row.algorithm in ("topka", "hitopk", "hitopk_leader") and not node_sum and row.select_seconds > 0:
            elements = row.terms()[f"select:{row.selector}"]
            samples.setdefault(row.selector, []).append((elements, row.select_seconds))
    return {selector: selection_line(points) for selector, points in samples.items()}


def nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| subject to x >= 0, by dropping negative coefficients and
    solving again until none is left (an active-set method for few columns)."""
    free = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    while free:
        solution, *_ = np.linalg.lstsq(a[:, free], b, rcond=None)
        if (solution >= 0).all():
            x[free] = solution
            break
        free = [column for column, value in zip(free, solution) if value > 0]
    return x


def fit(rows: Sequence[Measurement], base: Machine = CPU,
        rates: Optional[Mapping[str, Tuple[float, float]]] = None) -> Machine:
    """The machine that best explains ``rows`` (see the module docstring).

    ``rates`` are selection figures to start from (e.g. from bench_topk);
    the in-context rates of ``rows`` take precedence over them.
    """
    if not rows:
        raise ValueError("no measurements to fit")
    select = {**base.select, **(rates or {}), **in_context_rates(rows)}
    machine = base.replace(select=select)
    rows = pooled(rows)
    terms = [row.terms() for row in rows]
    seconds = np.array([row.seconds for row in rows])
    select_only = np.array([machine.seconds({t: a for t, a in ts.items() if t.startswith("select")}) for ts in terms])
    features = np.array([[ts.get(name, 0.0) for name in LINK_TERMS] for ts in terms])
    known = [j for j in range(len(LINK_TERMS)) if features[:, j].any()]
    a, b = features[:, known], seconds - select_only
    scale = a.max(axis=0)  # columns of messages and of bytes differ by orders of magnitude
    # Residuals relative to the prediction (iteratively reweighted): close to a
    # fit of log(predicted/measured), so a few outliers far below the rest
    # (bimodal timings of oversubscribed ranks) do not drag the fit down.
    weights = 1 / seconds
    for _ in range(REWEIGHTS):
        solution = nonnegative_lstsq(a / scale * weights[:, None], b * weights) / scale
        weights = 1 / np.maximum(a @ solution + select_only, seconds.min() / 10)
    return machine.replace(**{LINK_TERMS[j]: float(value) for j, value in zip(known, solution)})


def pooled(rows: Sequence[Measurement]) -> List[Measurement]:
    """One row per distinct setting: the median over repeated runs of it."""
    groups: Dict[tuple, List[Measurement]] = {}
    for row in rows:
        groups.setdefault((row.cluster, row.algorithm, row.size, row.dtype, row.density, row.selector), []).append(row)
    return [
        replace(group[0], seconds=median(r.seconds for r in group), select_seconds=median(r.select_seconds for r in group))
        for group in groups.values()
    ]


def relative_errors(machine: Machine, rows: Iterable[Measurement]) -> List[Tuple[Measurement, float, float]]:
    """(row, predicted seconds, |predicted - measured| / measured) of each row."""
    result = []
    for row in rows:
        predicted = machine.seconds(row.terms())
        result.append((row, predicted, abs(predicted - row.seconds) / row.seconds))
    return result


def load(paths: Sequence[str], base: Machine = CPU) -> Machine:
    """The machine described by calibration inputs, in order: a calibration
    file sets every figure, bench_topk files set selection rates, and all
    bench_comm files together are fitted last, on top of those."""
    machine, rates, rows = base, {}, []
    for path in paths:
        kind, document = read(path)
        if kind == "calibration":
            machine = machine_of(document, path)
        elif kind == "bench_topk":
            rates.update(topk_rates(document, path))
        else:
            rows.extend(measurements(document, path))
    if rows:
        return fit(rows, machine, rates)
    return machine.replace(select={**machine.select, **rates})


def save(path: str, machine: Machine, sources: Sequence[str], rows: Sequence[Measurement]) -> None:
    """Write a calibration file that ``load`` reads back."""
    errors = [error for _, _, error in relative_errors(machine, rows)]
    document = {
        "tool": TOOL,
        "format": FORMAT,
        "machine": machine.to_dict(),
        "fitted_on": list(sources),
        "rows": len(rows),
        "median_relative_error": median(errors) if errors else None,
    }
    write_json(path, document)
