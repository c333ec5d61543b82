#!/usr/bin/env python3
"""Turn this Linux machine (as root) into several emulated hosts joined by
rate-limited links, and run MPI programs across them.

    emucluster.py up --hosts 2 --ranks-per-host 2 --rate 1gbit --delay 50us
    emucluster.py run -- python drivers/bench_comm.py --sizes 16777216
    emucluster.py status          # the links and the bytes each host moved
    emucluster.py down            # removes everything `up` made

Each host is a network namespace with its own host name; ranks on one host
share memory, ranks on different hosts talk TCP through links shaped by tc,
and spar_comm finds the hosts by itself (no --ranks-per-node).
"""
from __future__ import annotations

import argparse
import sys

from spar_comm import emucluster


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="emucluster.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefix", default=emucluster.PREFIX,
                        help="name prefix of everything made (default: %(default)s)")
    verbs = parser.add_subparsers(dest="verb", required=True)
    make = verbs.add_parser("up", help="create the hosts, the bridge and the shaped links")
    make.add_argument("--hosts", type=int, default=2, help="emulated hosts (default: %(default)s)")
    make.add_argument("--ranks-per-host", type=int, default=2, help="MPI ranks per host (default: %(default)s)")
    make.add_argument("--rate", default="1gbit", help="link rate each way, tc syntax (default: %(default)s)")
    make.add_argument("--delay", default="0us", help="one-way delay host to host, tc syntax (default: %(default)s)")
    shape = verbs.add_parser("shape", help="change the rate and delay of every link of a running cluster")
    shape.add_argument("--rate", required=True)
    shape.add_argument("--delay", default="0us")
    launch = verbs.add_parser("run", help="mpiexec a command across the hosts: run [-n N] -- COMMAND...")
    launch.add_argument("-n", type=int, default=None, help="ranks (default: hosts x ranks per host)")
    launch.add_argument("--mpiexec", default=None, help="MPICH's mpiexec (default: the one beside this Python)")
    launch.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    verbs.add_parser("status", help="show the hosts, their links and byte counters")
    verbs.add_parser("down", help="remove everything with the prefix")
    args = parser.parse_args(argv)
    if args.verb == "run":
        args.command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not args.command:
            parser.error("run needs a command: emucluster.py run -- python prog.py ...")
    return args


def main() -> int:
    args = parse_args()
    try:
        if args.verb == "up":
            spec = emucluster.up(emucluster.ClusterSpec(args.hosts, args.ranks_per_host, args.rate, args.delay,
                                                        args.prefix))
            print(f"up: {spec.hosts} hosts x {spec.ranks_per_host} ranks, {spec.rate} each way, "
                  f"{spec.delay} delay; addresses {', '.join(spec.addresses)}")
        elif args.verb == "shape":
            spec = emucluster.reshape(emucluster.load(args.prefix), args.rate, args.delay)
            print(f"links now {spec.rate} each way, {spec.delay} delay")
        elif args.verb == "run":
            spec = emucluster.load(args.prefix)
            return emucluster.start(spec, args.command, args.mpiexec, args.n).wait_forwarding()
        elif args.verb == "status":
            spec = emucluster.load(args.prefix)
            print(f"{spec.hosts} hosts x {spec.ranks_per_host} ranks, {spec.rate} each way, {spec.delay} delay")
            for i, counters in enumerate(emucluster.link_counters(spec)):
                print(f"  {spec.namespace(i)}  {spec.addresses[i]:<14} sent {counters['tx_bytes']:>14,} B  "
                      f"received {counters['rx_bytes']:>14,} B")
        elif args.verb == "down":
            removed = emucluster.down(args.prefix)
            print(f"down: removed {len(removed)} namespaces and links" if removed else "down: nothing to remove")
    except ValueError as error:
        print(f"emucluster.py: error: {error}", file=sys.stderr)
        return 2
    except emucluster.EmuClusterError as error:
        print(f"emucluster.py: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if args.verb == "up":
            print("interrupted: removed what was made", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
