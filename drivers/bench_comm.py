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

import spar_comm  # noqa: E402
from spar_comm import ALGORITHMS, Topology  # noqa: E402
from spar_comm.bench import record  # noqa: E402
from spar_comm.bench.comm import CommSettings, LinkCounter, heading, lines, measure_sizes  # noqa: E402
from spar_comm.cli import comma_list, density, settings_from  # noqa: E402
from spar_comm.collectives.checks import DTYPES  # noqa: E402
from spar_comm.collectives.codecs import INDICES, VALUES  # noqa: E402
from spar_comm.kernels import SELECTORS  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402
from spar_comm.memory import DEVICES  # noqa: E402
from spar_comm.mpi_strings import library_name  # noqa: E402


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


def main() -> int:
    args = parse_args()
    topology = Topology(ranks_per_node=args.ranks_per_node, device=args.device)
    world = topology.world
    lead = world.rank == 0
    record.refuse_unwritable(world, args.out)
    links = LinkCounter(world, args.link_counters) if args.link_counters else None
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
    settings = settings_from(args, CommSettings)
    if lead:
        print(heading(topology, settings), flush=True)
    results = []
    for rows in measure_sizes(topology, args.sizes, settings, args.seed, links):
        results += rows
        if lead:
            print("\n".join(lines(rows, settings)), flush=True)
        if lead and args.out:
            record.write_record(args.out, meta, results=results)
    return 0


if __name__ == "__main__":
    run_main(main, "bench_comm.py")
