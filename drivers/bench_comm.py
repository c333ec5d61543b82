#!/usr/bin/env python3
"""Measure every allreduce algorithm at several gradient sizes.

Each call is timed on every rank and the slowest rank's time counts; the
figure reported is the median over --repeat calls after --warmup calls. The
calls go in rounds (one call of each algorithm, in a new order each round),
so a slow spell of a shared machine hits every algorithm alike, and no
algorithm always runs right after the same one. Each
call reduces into one output buffer kept from call to call
(``allreduce(grad, out=buffer)``); ``--in-place`` reduces into the gradient
itself (``out=grad``), as train.py, the torch optimizer and the DDP hook do,
with the gradient copied in again, untimed, before each call. The gradient is assembled in
each allreducer's ``.buffer``, as in a fusion buffer, which ``hier_dense``,
``hitopk`` and ``adasum`` keep in the node's shared memory (no copy in;
``--no-shared-buffer`` passes a private array instead). The table shows
time, CPU time (the process's, on the rank that used most: where ranks
share cores, what a call costs training however well it overlaps), both
also in reads (over one read of the gradient, ``grad.max()``, by every rank
at once, timed in the same rounds: the unit a memory-bound call is counted
in), the call's checks (every rank's verdict on its gradient, gathered
before anything changes: a pass for non-finite values and an Allgather of
16 bytes a rank), selection and communication time, and the bytes each rank
sends inside and between nodes (ring model, see spar_comm.collectives.channel).
``--deadlines both`` measures each allreducer with its waits' deadlines
(SPAR_COMM_TIMEOUT) and without, alternately in the same rounds: what a
deadline costs a healthy call.
``--count-passes`` adds the passes over memory one more call of each makes:
reads and writes of full-length arrays, in vectors of the gradient's length
(``spar_comm.bench.passes``), to check against docs/design.md's table.
``--device gpu`` puts each rank's gradient on its GPU as a CuPy array (the
bytes copied through host buffers, when MPI is not CUDA-aware, are in the
JSON as ``bytes_staged``); ``--device gpu-simulator`` runs that path on the
CPU under numba-cuda's simulator, for tests.
The JSON written to --out (after every size, so a killed run keeps what it
measured) is what the cost model is fitted on.

    mpiexec -n 4 python drivers/bench_comm.py --ranks-per-node 2 \\
        --sizes 262144,1048576,16777216 --density 0.001 --out bench_comm.json
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one BLAS thread per rank (powersgd's products), as train.py

import argparse  # noqa: E402
import functools  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import spar_comm  # noqa: E402
from spar_comm import ALGORITHMS, Topology, make_allreducer, waiting  # noqa: E402
from spar_comm.bench import passes, record, timing  # noqa: E402
from spar_comm.kernels import SELECTORS  # noqa: E402
from spar_comm.cli import comma_list, density  # noqa: E402
from spar_comm.collectives.checks import CODECS, DTYPES  # noqa: E402
from spar_comm.collectives.codecs import INDICES, VALUES  # noqa: E402
from spar_comm.consensus import raise_if_any  # noqa: E402
from spar_comm.files import unwritable  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402
from spar_comm.memory import DEVICES  # noqa: E402
from spar_comm.mpi_strings import library_name, processor_name  # noqa: E402

FIGURES = ("t_check", "t_select", "t_intra", "t_inter")
COUNTS = ("bytes_intra", "bytes_inter", "k", "bytes_staged")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench_comm.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=comma_list(int, lambda n: n >= 1, "an integer >= 1"), default=[262144, 1048576, 4194304],
                        help="gradient sizes in elements, comma-separated (default: 2^18,2^20,2^22)")
    parser.add_argument("--density", type=density, default=0.001, help="fraction selected (default: %(default)s)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS),
                        help="comma-separated subset of: %(default)s")
    parser.add_argument("--selector", default="mstopk" if "mstopk" in SELECTORS else "exact",
                        choices=sorted(SELECTORS), help="top-k method (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="gradient dtype; 16-bit ones are reduced and sent as float32 (default: %(default)s)")
    parser.add_argument("--device", default="cpu", choices=DEVICES,
                        help="where gradients live: gpu = CuPy arrays on GPU (place on host) %% count (default: cpu)")
    parser.add_argument("--ranks-per-node", type=int, default=None,
                        help="emulate nodes of this many consecutive ranks (default: real nodes)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls first (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=10, help="timed calls (default: %(default)s)")
    parser.add_argument("--values", choices=VALUES,
                        help="a value codec for the pairs of topka, hitopk and hitopk_leader (the others send as "
                             "they always do; default: as summed)")
    parser.add_argument("--rank", type=int, default=1, help="PowerSGD's rank, for powersgd (default: %(default)s)")
    parser.add_argument("--indices", choices=INDICES,
                        help="an index codec for the same pairs: auto takes int32, 16-bit gaps or a bitmap, "
                             "whichever is smallest (default: int32)")
    parser.add_argument("--shared-buffer", action=argparse.BooleanOptionalAction, default=True,
                        help="assemble the gradient in each allreducer's .buffer (default: %(default)s)")
    parser.add_argument("--in-place", action="store_true",
                        help="reduce into the gradient's own array (out=grad), as the training loops do, copying "
                             "the gradient in again before each call, untimed; default: into a buffer of its own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadlines", choices=["on", "off", "both"], default="on",
                        help="the waits' deadlines (SPAR_COMM_TIMEOUT): kept, removed, or both alternately, "
                             "each allreducer measured once each way a round (default: %(default)s)")
    parser.add_argument("--link-counters", metavar="IFACE",
                        help="also count the bytes every host's IFACE sends in one call of each algorithm, "
                             "from /sys/class/net/IFACE/statistics (an emulated cluster's emu0)")
    parser.add_argument("--count-passes", action="store_true",
                        help="also count the passes over memory one call of each algorithm makes, after the timed "
                             "ones: reads and writes of full-length arrays at the kernels' entry points, in vectors "
                             "of the gradient's length (docs/design.md's table)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.algorithms.split(",")) - set(ALGORITHMS))
    if unknown:
        parser.error(f"unknown algorithm(s) {', '.join(unknown)}; choose from {', '.join(ALGORITHMS)}")
    args.algorithms = args.algorithms.split(",")
    if args.ranks_per_node is not None and args.ranks_per_node < 1:
        parser.error("--ranks-per-node must be >= 1")
    if args.repeat < 1 or args.warmup < 0:
        parser.error("--repeat must be >= 1 and --warmup >= 0")
    return args


def options_of(algorithm: str, args: argparse.Namespace) -> dict:
    """The settings of ``args`` that ``algorithm`` takes beyond the common ones."""
    if algorithm == "powersgd":
        return dict(rank=args.rank)
    return {setting: getattr(args, setting) for setting in ("values", "indices") if algorithm in CODECS[setting]}


def gradient_arrays(reducers: list, grad, shared_buffer: bool, in_place: bool) -> list:
    """The array each reducer is given ``grad`` in: its ``.buffer`` with a shared
    buffer, else ``grad`` itself, or a copy of its own when it reduces in place."""
    sends = [reducer.buffer if shared_buffer else grad.copy() if in_place else grad for reducer in reducers]
    for send in sends:
        send[...] = grad
    return sends


def measure(reducers: list, sends: list, grad, warmup: int, repeat: int, deadlines: list,
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


def link_counter(world: MPI.Comm, iface: str) -> str | None:
    """The path of IFACE's sent-bytes counter on one rank of each host (None on
    the others). A host where it cannot be read makes every rank raise
    ConfigError, before anything is measured."""
    host = world.Split_type(MPI.COMM_TYPE_SHARED)
    reader = host.rank == 0
    host.Free()
    path = f"/sys/class/net/{iface}/statistics/tx_bytes"
    raise_if_any(world, None if not reader or os.access(path, os.R_OK) else
                 f"--link-counters {iface}: cannot read {path} on host {processor_name()}")
    return path if reader else None


def link_bytes(reducers: list, sends: list, out, counter: str | None) -> list:
    """Bytes sent on the hosts' links during one call of each reducer, summed
    over hosts (``counter`` is the path ``link_counter`` gave this rank; the
    barriers before and after add a few hundred bytes)."""
    world = reducers[0].topology.world

    def sent() -> int:
        if counter is None:
            return 0
        with open(counter) as stream:
            return int(stream.read())

    counts = []
    for reducer, send in zip(reducers, sends):
        world.Barrier()
        before = sent()
        reducer.allreduce(send, out=out)
        world.Barrier()
        counts.append(sent() - before)
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


def main() -> int:
    args = parse_args()
    topology = Topology(ranks_per_node=args.ranks_per_node, device=args.device)
    world = topology.world
    lead = world.rank == 0
    # Only rank 0 writes, so only its view of the file system counts; all ranks agree.
    raise_if_any(world, unwritable(args.out) if lead and args.out else None)
    counter = link_counter(world, args.link_counters) if args.link_counters else None
    meta = record.meta("bench_comm", topology.hosts, **{
        "spar_comm_version": spar_comm.__version__,
        "created": record.now(),
        "mpi_library": library_name(),
        "world_size": world.size,
        "num_nodes": topology.num_nodes,
        "node_sizes": topology.node_sizes,
        "ranks_per_node": topology.node_sizes[0],
        "emulated": topology.emulated_ranks_per_node is not None,
        "dtype": args.dtype,
        "density": args.density,
        "selector": args.selector,
        "rank": args.rank,
        "values": args.values,
        "indices": args.indices,
        "warmup": args.warmup,
        "repeat": args.repeat,
        "shared_buffer": args.shared_buffer,
        "in_place": args.in_place,
        "device": topology.memory.describe(),
    })
    results = []
    if lead:
        codec = "".join(f"; {name} {kind} for {', '.join(CODECS[kind])}"
                        for kind, name in (("values", args.values), ("indices", args.indices)) if name)
        print(f"# {topology.describe()}; {args.dtype}, density {args.density}, selector {args.selector}{codec}")
        print(f"# median of {args.repeat} calls after {args.warmup}, slowest rank; bytes sent per rank (most)")
        print("# reads: time and CPU over one read of the gradient by every rank at once, in the same rounds")
        header = f"{'size':>10} {'algorithm':<14} {'time ms':>9} {'vs dense':>8} {'cpu ms':>8} {'reads':>6} " \
                 f"{'cpu rd':>6} {'check':>7} {'select':>8} {'intra':>8} {'inter':>8} {'intra B':>12} {'inter B':>12}" \
                 + (f" {'passes':>6} {'R pass':>6} {'W pass':>6}" if args.count_passes else "")
        print(header, flush=True)
    rng = np.random.default_rng([args.seed, world.rank])
    for size in args.sizes:
        grad = topology.memory.xp.asarray(rng.standard_normal(size).astype(args.dtype))
        reducers = [make_allreducer(a, topology, size, args.dtype, args.density, args.selector,
                                    shared_buffer=args.shared_buffer,
                                    **options_of(a, args)) for a in args.algorithms]
        deadlines = {"on": [True], "off": [False], "both": [True, False]}[args.deadlines]
        sends = gradient_arrays(reducers, grad, args.shared_buffer, args.in_place)
        measured, read = measure(reducers, sends, grad, args.warmup, args.repeat, deadlines, args.in_place)
        modes = [(algorithm, on) for algorithm in args.algorithms for on in deadlines]
        if args.count_passes:
            sends = gradient_arrays(reducers, grad, args.shared_buffer, args.in_place)  # the gradient again
            out = None if args.in_place else topology.memory.xp.empty_like(grad)
            counts = [passes.counted_call(reducer, send, send if args.in_place else out)
                      for reducer, send in zip(reducers, sends)]
            for figures, counted in zip(measured, [counted for counted in counts for _ in deadlines]):
                figures["pass_count"], figures["pass_reads"], figures["pass_writes"] = (
                    counted["passes"], counted["reads"], counted["writes"])
        if args.link_counters:
            sends = gradient_arrays(reducers, grad, args.shared_buffer, False)
            counts = link_bytes(reducers, sends, topology.memory.xp.empty_like(grad), counter)
            for figures, count in zip(measured, [count for count in counts for _ in deadlines]):
                figures["link_bytes"] = count
        for reducer in reducers:
            reducer.free()
        times = {mode: figures["time_median"] for mode, figures in zip(modes, measured)}
        for (algorithm, on), figures in zip(modes, measured):
            row = {"algorithm": algorithm, "size": size, "nbytes": grad.nbytes, "read_median": read["time_median"],
                   "deadlines": on, **figures}
            results.append(row)
            if lead:
                dense_time = times.get(("dense", on))
                ratio = f"{dense_time / row['time_median']:7.1f}x" if dense_time else f"{'':>8}"
                name = algorithm if len(deadlines) == 1 else f"{algorithm} {'on' if on else 'off'}"
                print(f"{size:>10} {name:<14} {row['time_median'] * 1e3:9.3f} {ratio} "
                      f"{row['cpu_median'] * 1e3:8.3f} {row['time_reads']:6.2f} {row['cpu_reads']:6.2f} "
                      f"{row['t_check'] * 1e3:7.3f} {row['t_select'] * 1e3:8.3f} {row['t_intra'] * 1e3:8.3f} "
                      f"{row['t_inter'] * 1e3:8.3f} {row['bytes_intra']:>12,} {row['bytes_inter']:>12,}"
                      + (f" {row['pass_count']:6d} {row['pass_reads']:6.2f} {row['pass_writes']:6.2f}"
                         if args.count_passes else ""),
                      flush=True)
        if lead and args.out:
            record.write_record(args.out, meta, results=results)
    return 0


if __name__ == "__main__":
    run_main(main, "bench_comm.py")
