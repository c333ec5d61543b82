#!/usr/bin/env python3
"""What waiting for a late rank costs: CPU while waiting, and latency after.

spar_comm's small collectives wait by sleeping between tests of MPI's
nonblocking form (``SPAR_COMM_WAIT=sleep``, the default) or in ``MPI_Wait``
(``spin``). This measures both on your machine, so that you can choose: in
every round, rank 0 arrives ``--late-ms`` after the others at one small
collective, once waiting each way, the order alternating from round to round.
For each way it reports, as medians over the rounds:

* ``cpu``: the CPU time (``time.process_time``) a rank that waited used in the
  call, the most over the ranks that were on time;
* ``after``: how long rank 0, arriving last, spent in the call: the rounds
  of the collective, each waiting for the other ranks to wake (one clock, so
  it holds across hosts too).

Sleeping should cost a small part of the wait in CPU, and spinning all of it;
``after`` is the price sleeping pays. JSON out.

    mpiexec -n 4 python drivers/bench_waiting.py --out waiting.json
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from mpi4py import MPI

import spar_comm
from spar_comm import waiting
from spar_comm.bench import record
from spar_comm.bench.late_rank import COLLECTIVES, measure
from spar_comm.cli import positive_float, positive_int
from spar_comm.consensus import raise_if_any
from spar_comm.launch import run_main
from spar_comm.mpi_strings import library_name

#: The latest rank 0 may arrive, in ms.
LATEST_MS = 60_000.0


def late_ms(text: str) -> float:
    """A delay in ms, above 0 and at most ``LATEST_MS``."""
    value = positive_float(text)
    if value > LATEST_MS:
        raise argparse.ArgumentTypeError(f"at most {LATEST_MS:g} ms, got {text!r}")
    return value


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_waiting.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--collective", choices=COLLECTIVES, default="Allgather",
                        help="the call waited in, with one int32 a rank (default: %(default)s, as the check that "
                             "starts every allreduce)")
    parser.add_argument("--late-ms", type=late_ms, default=5.0,
                        help=f"how late rank 0 arrives, in ms, at most {LATEST_MS:g} (default: %(default)s)")
    parser.add_argument("--warmup", type=positive_int, default=5, help="untimed rounds (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=50, help="timed rounds (default: %(default)s)")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main() -> int:
    """Measure both ways round by round; rank 0 prints and writes the medians."""
    args = parse_args()
    comm = MPI.COMM_WORLD
    lead = comm.rank == 0
    record.refuse_unwritable(comm, args.out)
    raise_if_any(comm, None if comm.size > 1 else "needs at least 2 ranks: one late, one waiting")
    results = measure(comm, args.collective, args.late_ms / 1e3, args.warmup, args.repeat,
                      lambda line: print(line, file=sys.stderr, flush=True))
    hosts = record.hosts_of(comm)
    if lead:
        print(f"# {comm.size} ranks, {library_name()}; rank 0 {args.late_ms:g} ms late at {args.collective}; "
              f"medians of {args.repeat} rounds; longest pause {waiting.longest_pause(comm.size) * 1e6:.0f} us")
        print(f"{'way':<6} {'cpu ms':>8} {'of wait':>8} {'after us':>9} {'p90 us':>8}")
        for r in results:
            print(f"{r['way']:<6} {r['cpu_median'] * 1e3:8.3f} {r['cpu_median'] / (args.late_ms / 1e3):8.0%} "
                  f"{r['after_median'] * 1e6:9.0f} {r['after_p90'] * 1e6:8.0f}")
        if args.out:
            meta = record.meta("bench_waiting", hosts, spar_comm_version=spar_comm.__version__,
                               mpi_library=library_name(), created=record.now(), world_size=comm.size,
                               collective=args.collective, late_ms=args.late_ms, warmup=args.warmup,
                               repeat=args.repeat, longest_pause=waiting.longest_pause(comm.size))
            record.write_record(args.out, meta, results=results)
    return 0


if __name__ == "__main__":
    run_main(main, "bench_waiting.py")
