"""bench_comm.py's measurement: every allreducer at each gradient size,
its calls interleaved round by round with one read of the gradient (the
unit ``reads`` count in), each call's time the slowest rank's and its CPU
time the most any rank used; with it the call's checks, selection and
communication, the bytes each rank sent inside and between nodes, and on
request the passes over memory and the bytes on the hosts' links. The rows
are what the cost model is fitted on (``costmodel.calibrate.measurements``)."""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..costmodel.auto import make_allreducer
from ..collectives.checks import CODECS
from ..consensus import raise_if_any
from ..mpi_strings import processor_name
from ..topology import Topology
from . import passes, timing

FIGURES = ("t_check", "t_select", "t_intra", "t_inter")
COUNTS = ("bytes_intra", "bytes_inter", "k", "bytes_staged")
#: The waits' deadlines each allreducer is measured with, by --deadlines.
DEADLINES = {"on": [True], "off": [False], "both": [True, False]}


@dataclass(frozen=True)
class CommSettings:
    """What every allreducer is built with (density, selector, dtype, the
    codecs of those that take them, PowerSGD's ``rank``), where it is given
    the gradient (its shared ``.buffer``; reduced ``in_place``), the rounds,
    the deadlines (a key of ``DEADLINES``) and whether one more call of each
    counts its passes over memory."""

    algorithms: Sequence[str]
    density: float
    selector: str
    dtype: str
    values: Optional[str]
    indices: Optional[str]
    rank: int
    shared_buffer: bool
    in_place: bool
    warmup: int
    repeat: int
    deadlines: str
    count_passes: bool


def options_of(algorithm: str, settings: CommSettings) -> dict:
    """The settings that ``algorithm`` takes beyond the common ones."""
    if algorithm == "powersgd":
        return dict(rank=settings.rank)
    return {setting: getattr(settings, setting) for setting in ("values", "indices") if algorithm in CODECS[setting]}


def gradient_arrays(reducers: list, grad: Any, shared_buffer: bool, in_place: bool) -> list:
    """The array each reducer is given ``grad`` in: its ``.buffer`` with a shared
    buffer, else ``grad`` itself, or a copy of its own when it reduces in place."""
    sends = [reducer.buffer if shared_buffer else grad.copy() if in_place else grad for reducer in reducers]
    for send in sends:
        send[...] = grad
    return sends


def measure(reducers: list, sends: list, grad: Any, warmup: int, repeat: int, deadlines: list,
            in_place: bool = False) -> tuple:
    """For each reducer and each of ``deadlines`` (the waits' deadlines on or
    off): the median of the slowest rank's time per call, of the
    most CPU time a rank used in it, and of the call's figures; and the same
    two medians of one read of the gradient (``grad.max()``) by every rank at
    once, measured in the same rounds, the unit ``reads`` are counted in.
    Each round makes one call of each reducer and deadline and one read, in
    an order of its own (the same on every rank), so that no call always
    follows the same one. ``in_place``: each call reduces into its own
    gradient array, filled with ``grad`` again before it (untimed).
    ``grad`` is an array of the topology's memory (NumPy, or CuPy on a GPU); a
    call returns once its result is written, the device's stream included."""
    world = reducers[0].topology.world
    out = None if in_place else reducers[0].xp.empty_like(grad)  # a buffer kept from call to call

    def reduce(reducer, send, on: bool) -> None:
        with waiting.deadlines(on):
            reducer.allreduce(send, out=send if in_place else out)

    def refill(send) -> None:  # the next call's gradient, in place of the last one's result
        if in_place:
            send[...] = grad

    modes = [(reducer, send, on) for reducer, send in zip(reducers, sends) for on in deadlines]
    reducers = [reducer for reducer, _, _ in modes]
    calls = [functools.partial(reduce, reducer, send, on) for reducer, send, on in modes]
    calls.append(lambda: float(grad.max()))  # one read of the vector (float: the device's too)
    refills = [functools.partial(refill, send) for _, send, _ in modes] + [lambda: None]
    for _ in range(warmup):
        for call, fill in zip(calls, refills):
            fill()
            call()
    rows = np.zeros((len(calls), repeat, 2 + len(FIGURES)))
    for i in range(repeat):
        for j in np.random.default_rng(i).permutation(len(calls)):  # the same order on every rank
            call = calls[j]
            refills[j]()
            world.Barrier()
            start, cpu = MPI.Wtime(), time.process_time()
            call()
            rows[j, i, :2] = MPI.Wtime() - start, time.process_time() - cpu
            if j < len(reducers):
                rows[j, i, 2:] = [reducers[j].last[name] for name in FIGURES]
    slowest = timing.slowest(world, rows)
    sent = np.array([[r.last[name] for name in COUNTS] for r in reducers], np.int64)
    most, total = np.empty_like(sent), np.empty_like(sent)
    world.Allreduce(sent, most, op=MPI.MAX)
    world.Allreduce(sent, total, op=MPI.SUM)
    read = {"time_median": float(np.median(slowest[-1, :, 0])), "cpu_median": float(np.median(slowest[-1, :, 1]))}
    return [{**summary(times, figures, read), "bytes_inter_all_ranks": int(sum_[1])}
            for times, figures, sum_ in zip(slowest[:-1], most, total)], read


class LinkCounter:
    """The bytes a network interface has sent, read by one rank of each host
    (the others read 0), so that summed over ranks they are the hosts' total.
    Made collectively: a host where it cannot be read makes every rank raise
    ConfigError, before anything is measured."""

    def __init__(self, world: MPI.Comm, iface: str):
        host = world.Split_type(MPI.COMM_TYPE_SHARED)
        reader = host.rank == 0
        host.Free()
        path = f"/sys/class/net/{iface}/statistics/tx_bytes"
        raise_if_any(world, None if not reader or os.access(path, os.R_OK) else
                     f"--link-counters {iface}: cannot read {path} on host {processor_name()}")
        self.path = path if reader else None

    def sent(self) -> int:
        """The interface's sent bytes so far on this rank's host (0 on a rank that does not read)."""
        if self.path is None:
            return 0
        with open(self.path) as stream:
            return int(stream.read())


def link_bytes(reducers: list, sends: list, out: Any, links: LinkCounter) -> list:
    """Bytes sent on the hosts' links during one call of each reducer, summed
    over hosts (the barriers before and after add a few hundred bytes)."""
    world = reducers[0].topology.world
    counts = []
    for reducer, send in zip(reducers, sends):
        world.Barrier()
        before = links.sent()
        reducer.allreduce(send, out=out)
        world.Barrier()
        counts.append(links.sent() - before)
    return world.allreduce(np.array(counts, np.int64)).tolist()


def summary(slowest: np.ndarray, most: np.ndarray, read: dict) -> dict:
    """One reducer's row: ``slowest`` is (repeat, time + CPU time + FIGURES),
    ``most`` its COUNTS, ``read`` the medians of one read of the gradient."""
    medians = np.median(slowest, axis=0)
    return {
        "time_median": float(medians[0]),
        "time_p10": float(np.percentile(slowest[:, 0], 10)),
        "time_p90": float(np.percentile(slowest[:, 0], 90)),
        "times": slowest[:, 0].tolist(),
        "cpu_median": float(medians[1]),
        "time_reads": float(medians[0]) / read["time_median"],
        "cpu_reads": float(medians[1]) / read["time_median"],
        **{name: float(value) for name, value in zip(FIGURES, medians[2:])},
        **{name: int(value) for name, value in zip(COUNTS, most)},
    }


def measure_sizes(topology: Topology, sizes: Sequence[int], settings: CommSettings, seed: int,
                  links: Optional[LinkCounter] = None) -> Iterator[List[dict]]:
    """Each size's rows in turn, one per allreducer and deadline, as soon as
    they are measured (collective): a Gaussian gradient of this rank's own
    (``seed`` and the rank), the allreducers built for it and freed after.
    With ``links`` (on every rank, or on none), one more call of each counts
    the bytes on the hosts' links."""
    world = topology.world
    rng = np.random.default_rng([seed, world.rank])
    deadlines = DEADLINES[settings.deadlines]
    for size in sizes:
        grad = topology.memory.xp.asarray(rng.standard_normal(size).astype(settings.dtype))
        reducers = [make_allreducer(a, topology, size, settings.dtype, settings.density, settings.selector,
                                    shared_buffer=settings.shared_buffer, **options_of(a, settings))
                    for a in settings.algorithms]
        sends = gradient_arrays(reducers, grad, settings.shared_buffer, settings.in_place)
        measured, read = measure(reducers, sends, grad, settings.warmup, settings.repeat, deadlines,
                                 settings.in_place)
        if settings.count_passes:
            sends = gradient_arrays(reducers, grad, settings.shared_buffer, settings.in_place)  # the gradient again
            out = None if settings.in_place else topology.memory.xp.empty_like(grad)
            counts = [passes.counted_call(reducer, send, send if settings.in_place else out)
                      for reducer, send in zip(reducers, sends)]
            for figures, counted in zip(measured, [counted for counted in counts for _ in deadlines]):
                figures["pass_count"], figures["pass_reads"], figures["pass_writes"] = (
                    counted["passes"], counted["reads"], counted["writes"])
        if links is not None:
            sends = gradient_arrays(reducers, grad, settings.shared_buffer, False)
            counts = link_bytes(reducers, sends, topology.memory.xp.empty_like(grad), links)
            for figures, count in zip(measured, [count for count in counts for _ in deadlines]):
                figures["link_bytes"] = count
        for reducer in reducers:
            reducer.free()
        modes = [(algorithm, on) for algorithm in settings.algorithms for on in deadlines]
        yield [{"algorithm": algorithm, "size": size, "nbytes": grad.nbytes, "read_median": read["time_median"],
                "deadlines": on, **figures} for (algorithm, on), figures in zip(modes, measured)]


def heading(topology: Topology, settings: CommSettings) -> str:
    """What the table measures, and its column names."""
    codec = "".join(f"; {name} {kind} for {', '.join(CODECS[kind])}"
                    for kind, name in (("values", settings.values), ("indices", settings.indices)) if name)
    return "\n".join([
        f"# {topology.describe()}; {settings.dtype}, density {settings.density}, selector {settings.selector}{codec}",
        f"# median of {settings.repeat} calls after {settings.warmup}, slowest rank; bytes sent per rank (most)",
        "# reads: time and CPU over one read of the gradient by every rank at once, in the same rounds",
        f"{'size':>10} {'algorithm':<14} {'time ms':>9} {'vs dense':>8} {'cpu ms':>8} {'reads':>6} "
        f"{'cpu rd':>6} {'check':>7} {'select':>8} {'intra':>8} {'inter':>8} {'intra B':>12} {'inter B':>12}"
        + (f" {'passes':>6} {'R pass':>6} {'W pass':>6}" if settings.count_passes else "")])


def lines(rows: List[dict], settings: CommSettings) -> List[str]:
    """The table's line of each of one size's rows, its time against dense's
    with the same deadlines."""
    dense = {row["deadlines"]: row["time_median"] for row in rows if row["algorithm"] == "dense"}
    both = len(DEADLINES[settings.deadlines]) > 1
    found = []
    for row in rows:
        dense_time = dense.get(row["deadlines"])
        ratio = f"{dense_time / row['time_median']:7.1f}x" if dense_time else f"{'':>8}"
        name = f"{row['algorithm']} {'on' if row['deadlines'] else 'off'}" if both else row["algorithm"]
        found.append(f"{row['size']:>10} {name:<14} {row['time_median'] * 1e3:9.3f} {ratio} "
                     f"{row['cpu_median'] * 1e3:8.3f} {row['time_reads']:6.2f} {row['cpu_reads']:6.2f} "
                     f"{row['t_check'] * 1e3:7.3f} {row['t_select'] * 1e3:8.3f} {row['t_intra'] * 1e3:8.3f} "
                     f"{row['t_inter'] * 1e3:8.3f} {row['bytes_intra']:>12,} {row['bytes_inter']:>12,}"
                     + (f" {row['pass_count']:6d} {row['pass_reads']:6.2f} {row['pass_writes']:6.2f}"
                        if settings.count_passes else ""))
    return found
