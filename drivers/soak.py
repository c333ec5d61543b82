#!/usr/bin/env python3
"""Soak: many steps with every algorithm in turn, then many builds and frees,
watching each rank for leaks.

A long training job calls one allreducer hundreds of thousands of times, and a
framework adapter may build and free one per bucket size. Either leaks slowly
if a call or a build keeps anything: memory, a file descriptor, a window of
shared memory. Each rank records its resident memory (VmRSS of
/proc/self/status), its open file descriptors (/proc/self/fd) and the
shared-memory segments it has mapped (/dev/shm files in /proc/self/maps) at
the start (after one warm-up call of each allreducer, so that first-call
allocations do not count), after --steps steps (step i calls algorithm
i mod 6), and after one allreducer of each kind has been built, called once
and freed --rebuilds times. The growth against the start, worst rank, must stay
under --bound; otherwise the exit status is 1. The JSON lists every rank's
segments, so a caller can check that none is left in /dev/shm after the exit.

    mpiexec -n 4 python drivers/soak.py --ranks-per-node 2 --steps 10000 --rebuilds 100 --out soak.json
"""
from __future__ import annotations

import argparse

from spar_comm import ALGORITHMS, Topology
from spar_comm.bench.record import meta, refuse_unwritable
from spar_comm.bench.resources import growth_table, worst
from spar_comm.bench.soak import soak
from spar_comm.cli import comma_list, density, positive_float, positive_int
from spar_comm.files import write_json
from spar_comm.launch import run_main
from spar_comm.mpi_strings import library_name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="soak.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=positive_int, default=10000, help="allreduce calls, algorithms in turn (default: %(default)s)")
    parser.add_argument("--rebuilds", type=positive_int, default=100,
                        help="builds and frees of each algorithm's allreducer (default: %(default)s)")
    parser.add_argument("--size", type=positive_int, default=1 << 16, help="gradient elements (default: %(default)s)")
    parser.add_argument("--density", type=density, default=0.01, help="(default: %(default)s)")
    parser.add_argument("--selector", default="mstopk", help="(default: %(default)s)")
    parser.add_argument("--algorithms", type=comma_list(str, ALGORITHMS.__contains__, f"one of {', '.join(ALGORITHMS)}"),
                        default=list(ALGORITHMS), help="(default: all)")
    parser.add_argument("--ranks-per-node", type=positive_int, help="emulated node size (default: real nodes)")
    parser.add_argument("--bound", type=positive_float, default=0.05,
                        help="largest growth allowed against the start, as a fraction (default: %(default)s)")
    parser.add_argument("--out", help="JSON results")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    topology = Topology(ranks_per_node=args.ranks_per_node)
    world = topology.world
    lead = world.rank == 0
    refuse_unwritable(world, args.out)
    snapshots, seconds = soak(topology, args.algorithms, args.size, args.density, args.selector, args.steps,
                              args.rebuilds, lambda line: print(line, flush=True))
    verdicts = {phase: worst(snapshots, phase) for phase in ("steps", "rebuilt")}
    passed = all(value < args.bound for figures in verdicts.values() for value in figures.values())
    if lead:
        print(growth_table(snapshots, verdicts))
        print(f"{'passed' if passed else 'FAILED'}: growth bound {args.bound:.0%}, {args.steps} steps over "
              f"{', '.join(args.algorithms)}, {args.rebuilds} builds of each; {topology.describe().split(';')[0]}")
        if args.out:
            document = {"meta": meta("soak", topology.hosts, **vars(args), world_size=world.size,
                                     topology=topology.describe(), mpi_library=library_name()),
                        "seconds": seconds, "snapshots": snapshots, "growth": verdicts, "passed": passed}
            write_json(args.out, document)
    return 0 if passed else 1


if __name__ == "__main__":
    run_main(main, "soak.py")
