"""What a checkpoint costs each rank: save and load time, and how much a
rank's resident memory grows while it saves, against the state it holds.

    mpiexec -n 4 python drivers/bench_checkpoint.py --parameters 16777216 --out ck.json

Every rank builds the state of a training run of ``--parameters``
parameters (the parameters, the optimizer's velocity, the allreducer with a
residual from one real call, the convergence aids' velocity) and saves and
loads it ``--repeat`` times through the library's ``save_checkpoint`` and
``read_saved``/``load_checkpoint``. Times are the slowest rank's, medians
over the repeats. A thread samples the rank's resident memory every
millisecond during a save; the growth is its peak over the resident memory
just before, and ``state`` is what the rank holds of the run (parameters,
velocity, residual and aids' velocity), so ``growth / state`` says whether
a save costs a rank its own state or the world's
(``spar_comm.bench.checkpoint_cost``).
"""
from __future__ import annotations

import argparse

from spar_comm.bench.checkpoint_cost import measure
from spar_comm.bench.record import hosts_of, meta, refuse_unwritable, write_record
from spar_comm.cli import positive_int
from spar_comm.launch import run_main
from spar_comm.topology import Topology
from spar_comm.training import checkpoint
from spar_comm.training.distributed import Group


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parameters", type=positive_int, default=1 << 24,
                        help="parameters of the model (default: %(default)s)")
    parser.add_argument("--algorithm", default="topka",
                        help="whose residual the ranks keep: topka holds the whole vector on every rank, hitopk a "
                             "shard (default: %(default)s)")
    parser.add_argument("--ranks-per-node", type=int, default=None, help="emulated nodes of this many ranks")
    parser.add_argument("--repeat", type=positive_int, default=3, help="saves and loads (default: %(default)s)")
    parser.add_argument("--folder", default=None, help="where to write the checkpoints (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="JSON record of the figures")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args()
    topology = Topology(ranks_per_node=args.ranks_per_node)
    group = Group(topology)
    world = topology.world
    refuse_unwritable(world, args.out)
    result = measure(group, args.parameters, args.algorithm, args.repeat, args.folder)
    hosts = hosts_of(world)
    if world.rank == 0:
        growth = max(result["growth_per_rank_kib"])
        print(f"{topology.describe().split(';')[0]}, {args.parameters:,} parameters, "
              f"{args.algorithm}: save {result['save_s']:.3f} s, load {result['load_s']:.3f} s (slowest rank, "
              f"median of {args.repeat}); a rank's RSS grew by at most {growth / 1024:.1f} MiB while saving, "
              f"{result['growth_over_state']:.2f}x its state of {result['state_kib'] / 1024:.1f} MiB", flush=True)
        if args.out:
            write_record(args.out, meta("bench_checkpoint", hosts, world_size=world.size,
                                        node_sizes=topology.node_sizes, parameters=args.parameters,
                                        algorithm=args.algorithm, repeat=args.repeat,
                                        format=checkpoint.FORMAT),
                         results=[result])
    return 0


if __name__ == "__main__":
    run_main(main, "bench_checkpoint.py")
