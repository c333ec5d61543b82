#!/usr/bin/env python
"""What the optax transformation costs on top of the allreducer it calls.

For each size, a one-leaf float32 gradient goes through the jitted
``spar_comm.jax.sparse_allreduce`` update, and the same gradient as a NumPy
array straight through an allreducer of the same algorithm. The two
alternate call by call, so a slow spell of the machine hits both alike. Each
call counts the slowest rank; figures are medians after warm-up.

    overhead = jax update / allreducer alone

The difference is the host callback: moving the vector to the host and back,
loading and returning the residual, JAX's dispatch. JSON out.

    mpiexec -n 4 python drivers/bench_jax.py --ranks-per-node 2 --sizes 65536,1048576 --out jax.json
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")  # the ranks fill the cores already

import argparse  # noqa: E402

import jax  # noqa: E402

import spar_comm  # noqa: E402
from spar_comm import ALGORITHMS, Topology  # noqa: E402
from spar_comm.bench import record  # noqa: E402
from spar_comm.bench.jax_overhead import measure  # noqa: E402
from spar_comm.cli import comma_list, density, positive_int  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_jax.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=comma_list(int, lambda n: n >= 1, "an integer >= 1"), default=[65536, 1048576],
                        help="gradient sizes in elements, comma-separated (default: 2^16,2^20)")
    parser.add_argument("--algorithms", type=comma_list(str, ALGORITHMS.__contains__, f"one of {', '.join(ALGORITHMS)}"),
                        default=["dense", "hitopk"], help="comma-separated (default: dense,hitopk)")
    parser.add_argument("--density", type=density, default=0.01, help="fraction selected (default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=positive_int, default=None,
                        help="emulate nodes of this many consecutive ranks (default: real nodes)")
    parser.add_argument("--warmup", type=positive_int, default=3, help="untimed calls first (default: %(default)s)")
    parser.add_argument("--repeat", type=positive_int, default=20, help="timed calls (default: %(default)s)")
    parser.add_argument("--out", help="write the results as JSON here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    topology = Topology(ranks_per_node=args.ranks_per_node)
    world = topology.world
    lead = world.rank == 0
    record.refuse_unwritable(world, args.out)
    rows = []
    if lead:
        print(f"# {topology.describe()}; density {args.density}; median of {args.repeat} after {args.warmup}, slowest rank")
        print(f"{'size':>10} {'algorithm':<14} {'jax ms':>9} {'alone ms':>9} {'overhead':>8}", flush=True)
    for size in args.sizes:
        for algorithm in args.algorithms:
            row = measure(algorithm, size, args.density, topology, args.warmup, args.repeat)
            rows.append(row)
            if lead:
                print(f"{size:>10} {algorithm:<14} {row['jax_update_s'] * 1e3:9.3f} {row['allreducer_s'] * 1e3:9.3f} "
                      f"{row['overhead']:7.2f}x", flush=True)
    if lead and args.out:
        meta = record.meta("bench_jax", topology.hosts, spar_comm_version=spar_comm.__version__,
                           jax_version=jax.__version__, created=record.now(), world_size=world.size,
                           num_nodes=topology.num_nodes, density=args.density, warmup=args.warmup,
                           repeat=args.repeat)
        record.write_record(args.out, meta, results=rows)


if __name__ == "__main__":
    run_main(main, "bench_jax.py")
