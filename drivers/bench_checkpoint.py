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
a save costs a rank its own state or the world's.
"""
from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import numpy as np

from spar_comm.bench.record import hosts_of, meta, write_record
from spar_comm.bench.timing import slowest
from spar_comm.cli import positive_int
from spar_comm.consensus import raise_if_any
from spar_comm.files import unwritable
from spar_comm.launch import run_main
from spar_comm.topology import Topology
from spar_comm.training import checkpoint
from spar_comm.training.aids import ScheduledAllreduce
from spar_comm.training.config import TrainConfig
from spar_comm.training.data import Shards
from spar_comm.training.density import make_schedule
from spar_comm.training.distributed import Group
from spar_comm.training.layout import ParamLayout
from spar_comm.training.state import TrainState

FIGURES = ("save_s", "load_s", "growth_kib")


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


class PeakRSS:
    """The peak resident memory of this process while the block runs, sampled
    every millisecond, in KiB above what it was at the start."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = _rss_kib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.001):
            self.peak = max(self.peak, _rss_kib())

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_kib())
        self.growth = self.peak - self.start


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def build_state(group: Group, size: int, algorithm: str) -> TrainState:
    """A run's state on this rank: arrays of the given size, a residual from one real call."""
    layout = ParamLayout([("w", (size,))])
    config = TrainConfig(algorithm=algorithm, density=0.001, selector="exact", trace="")
    rng = np.random.default_rng(group.rank)
    schedule = make_schedule("fixed", 0.001, 100)
    allreduce = ScheduledAllreduce(group, algorithm, size, "float32", "exact", schedule)
    allreduce.reduce(0, rng.standard_normal(size).astype(np.float32), np)
    params, velocity, local = (rng.standard_normal(size).astype(np.float32) for _ in range(3))
    return TrainState(group, config, layout, params, velocity, allreduce,
                      Shards(100 * group.size, group.rank, group.size, 1, 0), schedule, local_velocity=local, step=5)


def main() -> int:
    args = parse_args()
    topology = Topology(ranks_per_node=args.ranks_per_node)
    group = Group(topology)
    world = topology.world
    raise_if_any(world, unwritable(args.out) if world.rank == 0 and args.out else None)
    state = build_state(group, args.parameters, args.algorithm)
    state_kib = (sum(array.nbytes for array in (state.params, state.velocity, state.local_velocity))
                 + state.allreduce.residual()[1].nbytes) // 1024
    folder = args.folder or (tempfile.mkdtemp(prefix="bench_checkpoint-") if world.rank == 0 else None)
    folder = world.bcast(folder, root=0)
    rows = np.zeros((args.repeat, len(FIGURES)))
    try:
        for i in range(args.repeat):
            path = os.path.join(folder, f"ck{i}.h5")
            world.Barrier()
            began = time.perf_counter()
            with PeakRSS() as memory:
                checkpoint.save_checkpoint(state, path)
            saved = time.perf_counter()
            world.Barrier()
            load_began = time.perf_counter()
            checkpoint.load_checkpoint(checkpoint.read_saved(path, group, state.layout), path, state)
            rows[i] = (saved - began, time.perf_counter() - load_began, memory.growth)
    finally:
        world.Barrier()
        if world.rank == 0 and args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    worst = slowest(world, rows)
    growths = world.gather(rows[:, 2].max(), root=0)
    hosts = hosts_of(world)
    if world.rank == 0:
        medians = dict(zip(FIGURES, np.median(worst, axis=0).tolist()))
        result = {**medians, "state_kib": state_kib, "growth_per_rank_kib": growths,
                  "growth_over_state": max(growths) / state_kib}
        print(f"{topology.describe().split(';')[0]}, {args.parameters:,} parameters, "
              f"{args.algorithm}: save {medians['save_s']:.3f} s, load {medians['load_s']:.3f} s (slowest rank, "
              f"median of {args.repeat}); a rank's RSS grew by at most {max(growths) / 1024:.1f} MiB while saving, "
              f"{result['growth_over_state']:.2f}x its state of {state_kib / 1024:.1f} MiB", flush=True)
        if args.out:
            write_record(args.out, meta("bench_checkpoint", hosts, world_size=world.size,
                                        node_sizes=topology.node_sizes, parameters=args.parameters,
                                        algorithm=args.algorithm, repeat=args.repeat,
                                        format=checkpoint.FORMAT),
                         results=[result])
    return 0


if __name__ == "__main__":
    run_main(main, "bench_checkpoint.py")
