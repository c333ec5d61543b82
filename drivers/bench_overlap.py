#!/usr/bin/env python
"""How much gradient communication spar_comm.torch hides behind backward.

A torch MLP (about 17M parameters by default) trains the same steps twice
over: once with buckets reduced on the communication thread while backward
runs (overlap), once with every bucket reduced after backward (sync). The two
alternate step by step, so a slow spell of the machine hits both alike. Each
step counts the slowest rank; figures are medians after warm-up.

    hidden = (sync step - overlap step) / communication

where communication is what the sync run waits in synchronize(). JSON out.

    mpiexec -n 4 python drivers/bench_overlap.py --ranks-per-node 2 --out overlap.json
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks fill the cores already

import argparse  # noqa: E402
import datetime  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import spar_comm  # noqa: E402
from spar_comm import ALGORITHMS, Topology, retain_freed_memory  # noqa: E402
from spar_comm.bench.overlap import OverlapSettings, measure  # noqa: E402
from spar_comm.bench.record import meta, refuse_unwritable  # noqa: E402
from spar_comm.cli import comma_list, density, positive_float, positive_int, settings_from  # noqa: E402
from spar_comm.files import write_json  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_overlap.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithms", type=comma_list(str, ALGORITHMS.__contains__, f"one of {', '.join(ALGORITHMS)}"),
                        default=["hitopk", "dense"], help="comma-separated (default: hitopk,dense)")
    parser.add_argument("--density", type=density, default=0.001, help="(default: %(default)s)")
    parser.add_argument("--inputs", type=positive_int, default=256, help="MLP input width (default: %(default)s)")
    parser.add_argument("--hidden", type=positive_int, default=2048, help="MLP width (default: %(default)s)")
    parser.add_argument("--layers", type=positive_int, default=4,
                        help="hidden-to-hidden layers (default: %(default)s; with the defaults ~17.3M parameters)")
    parser.add_argument("--batch-size", type=positive_int, default=32, help="per rank (default: %(default)s)")
    parser.add_argument("--bucket-cap-mb", type=positive_float, default=25, help="(default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=None,
                        help="emulate nodes of this many consecutive ranks (default: real nodes)")
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed steps per mode (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=8, help="timed steps per mode (default: %(default)s)")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    world = MPI.COMM_WORLD
    refuse_unwritable(world, args.out)
    torch.set_num_threads(1)
    retain_freed_memory()  # a CPU step reuses its freed tensors instead of page-faulting new ones
    topology = Topology(ranks_per_node=args.ranks_per_node)
    settings = settings_from(args, OverlapSettings)
    results = [measure(settings, algorithm, topology) for algorithm in args.algorithms]
    if world.rank:
        return
    print(f"{world.size} ranks, {topology.describe().split(';')[0]}; ms per step, slowest rank, median of {args.repeat}")
    print(f"{'algorithm':<14}{'params':>12}{'buckets':>8}{'backward':>10}{'comm':>9}{'sync':>9}{'overlap':>9}{'hidden':>8}")
    for r in results:
        print(f"{r['algorithm']:<14}{r['parameters']:>12,}{r['buckets']:>8}{1e3 * r['backward']:>10.1f}"
              f"{1e3 * r['communication']:>9.1f}{1e3 * r['sync']['step']:>9.1f}{1e3 * r['overlap']['step']:>9.1f}"
              f"{100 * r['hidden']:>7.0f}%")
    if args.out:
        document = dict(
            meta=meta("bench_overlap", topology.hosts, world_size=world.size, topology=topology.describe()),
            benchmark="bench_overlap", version=spar_comm.__version__, world_size=world.size,
            topology=topology.describe(), created=datetime.datetime.now(datetime.timezone.utc).isoformat(),
            settings={k: v for k, v in vars(args).items() if k != "out"}, results=results,
        )
        write_json(args.out, document)


if __name__ == "__main__":
    run_main(main, "bench_overlap.py")
