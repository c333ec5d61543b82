#!/usr/bin/env python
"""spar_comm against what PyTorch users run today, on the same model, data and
ranks in one run.

Every mode holds its own replica of the model and its own optimizer; the
modes take their steps in turn (one step each, round after round), so a slow
spell of the machine hits all alike, and each round starts one mode later
than the last, so that no mode always follows the same one (on a shared
machine the mode that runs right after torch's peers is slowed). A step's
time is the slowest rank's; figures are medians of the timed rounds after
warm-up, with means beside them: a local-step mode's median is its inner
step, its mean counts the outer step every H rounds (time whole periods:
--repeat a multiple of --sync-every). Bytes between nodes are means too.

  ddp                DistributedDataParallel on gloo
  ddp_fp16           DDP + fp16_compress_hook
  ddp_powersgd_r1/4  DDP + powerSGD_hook at rank 1 and 4 (compressing from its step 2)
  spar_<algorithm>   spar_comm.torch.DistributedOptimizer with each algorithm, and auto
  spar_dense_float16 spar_comm's dense sum in float16 (against ddp_fp16), with error feedback
  spar_dense_int8    ... in int8 blocks (ZeRO++'s qgZ)
  spar_hitopk_int8   hitopk with int8 values and automatic indices
  spar_hitopk_spin   hitopk waiting in MPI_Wait (SPAR_COMM_WAIT=spin) rather than asleep
  spar_hook          DDP + spar_comm.torch.comm_hook (hitopk)
  spar_<mode>_torch  spar_dense, spar_hier_dense, spar_topka, spar_hitopk, spar_auto and spar_hook
                     over torch.distributed's gloo group (the torch transport)
                     instead of MPI, on the same nodes
  fsdp               FSDP2 (fully_shard on each block and the root) over the whole job
  hsdp               torch's HSDP: FSDP2 on a 2-D mesh of the nodes, dense all-reduce between them
  hsdp_spar_topka    FSDP2 across each node, its shards reduced between nodes by
                     spar_comm.torch.hsdp_hook (topka; _int8: with int8 values)
  fsdp_per_node      FSDP2 across each node, nothing between nodes: the sharded modes' floor
  diloco             local steps of the workload's optimizer, an outer step every --sync-every
                     (spar_comm.torch.OuterLoop): DiLoCo's Nesterov (lr 0.7, momentum 0.9) on the
                     dense pseudo-gradient; _int8: in int8 blocks
  local_hitopk       ... the sparse outer loop: hitopk at --outer-density with error feedback alone
                     (SparseLoCo's lr 1, no momentum); _int8: with int8 values; _int8_overlap
                     (and diloco_int8_overlap): the reduction beside the next --overlap-steps
  no_comm            the same step with no communication: the floor

The sharded modes run in the rank's own process over torch.distributed's
group, and every rank evaluates them. Under torchrun (no MPI launch) the
modes over torch, the sharded modes and no_comm run:

    torchrun --nproc-per-node 2 drivers/bench_peers.py mlp --ranks-per-node 1

A mode that fails is reported as failed, with each rank's error, on every
rank alike. torch's modes run in processes of their own (forked from each
rank, on a gloo group of their own), since gloo ends the whole process on
some collective mismatches and DDP can wait for ever on a hook that went
wrong: a peer that crashes or stays silent past --peer-timeout is failed,
and the others go on.

Bytes between nodes are per rank and step. spar_comm's modes report what they
sent. For DDP they follow from the parameter shapes: gloo's ring allreduce of
n bytes over p ranks sends 2(p-1)/p n from each rank; fp16 halves n; PowerSGD
sends P (rows x rank) and Q (columns x rank) of every matrix it compresses
and the rest whole, by torch's own rule (min_compression_rate 2). As for
spar_comm's dense, everything counts as between nodes once the job spans two;
BatchNorm buffers that DDP broadcasts are left out.

For spar_comm's optimizer modes a second table says where the communication
went: selection, MPI inside and between nodes and the allreducers' own
passes over memory, the copies of gradients into the buckets (the results
stay there, as .grad views), and how long step() still waited after backward.

Time to target (gpt, cnn): with --eval-every R, rank 0 measures every mode's
held-out metric (the GPT's validation loss, the CNN's accuracy) every R
rounds, and the report gives each mode's training time to each of
--targets: its slowest rank's step times summed, evaluations not counted.
Every mode trains with the workload's optimizer (AdamW for the GPT, SGD with
momentum for the CNN, as their train_*.py scripts do) from the same weights
on the same batches.

    mpiexec -n 4 python drivers/bench_peers.py mlp --ranks-per-node 2 --out peers.json --plot peers.png
    mpiexec -n 2 python drivers/bench_peers.py gpt --tiny --warmup 2 --repeat 2
    mpiexec -n 4 python drivers/bench_peers.py cnn --ranks-per-node 2 --modes ddp,spar_hitopk \\
        --density 0.01 --warmup 3 --repeat 297 --eval-every 25 --targets 0.9,0.95

Across hosts, gloo needs GLOO_SOCKET_IFNAME, the interface between them
(emu0 on the emulated cluster); rank 0's address on it is the rendezvous.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the ranks fill the cores already

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import resource  # noqa: E402
from typing import Callable, List, Optional, Tuple  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

import spar_comm  # noqa: E402
import spar_comm.torch as sct  # noqa: E402
from spar_comm import Topology, retain_freed_memory  # noqa: E402
from spar_comm.bench.peer_report import plot, table, title  # noqa: E402
from spar_comm.bench.peer_rounds import measure  # noqa: E402
from spar_comm.bench.peer_runners import start_torch, under_torchrun  # noqa: E402
from spar_comm.bench.peer_workloads import cnn_workload, gpt_workload, mlp_workload  # noqa: E402
from spar_comm.bench.peers import MODES, PEERS, UNDER_TORCHRUN, PeerSettings, Workload  # noqa: E402
from spar_comm.bench.record import meta  # noqa: E402
from spar_comm.cli import comma_list, density, positive_float, positive_int, settings_from  # noqa: E402
from spar_comm.consensus import raise_if_any  # noqa: E402
from spar_comm.files import unwritable, write_json  # noqa: E402
from spar_comm.kernels import SELECTORS  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402
from spar_comm.torch.transport import TorchComm  # noqa: E402
from spar_comm.workloads.command_line import add_gpt_arguments, add_resnet_arguments, gpt_config  # noqa: E402


def parse_args(argv=None) -> Tuple[argparse.Namespace, Callable[..., Workload]]:
    """The flags, and the workload they name (given the batch size, learning rate, seed and rank)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--modes", type=comma_list(str, MODES.__contains__, f"one of {', '.join(MODES)}"),
                        help="comma-separated (default: all; under torchrun: the modes over torch, and no_comm)")
    common.add_argument("--density", type=density, default=0.001,
                        help="spar_comm's share of each gradient sent (default: %(default)s)")
    common.add_argument("--selector", choices=sorted(SELECTORS), default="mstopk",
                        help="spar_comm's top-k selector (default: %(default)s)")
    common.add_argument("--dense-below", type=positive_int, default=None, metavar="ELEMENTS",
                        help="spar_comm's optimizer modes: reduce parameters of fewer elements densely "
                             "(DistributedOptimizer's dense=: norms, biases, small embeddings)")
    common.add_argument("--batch-size", type=positive_int, default=32, help="per rank (default: %(default)s)")
    common.add_argument("--bucket-cap-mb", type=positive_float, default=25,
                        help="DDP's and spar_comm's buckets (default: %(default)s)")
    common.add_argument("--powersgd-one-bucket", action="store_true",
                        help="give PowerSGD's DDP one bucket for the whole model (it fails on gloo with several)")
    common.add_argument("--ranks-per-node", type=positive_int, default=None,
                        help="emulate nodes of this many consecutive ranks (default: real nodes)")
    common.add_argument("--warmup", type=positive_int, default=3, help="untimed rounds (default: %(default)s)")
    common.add_argument("--repeat", type=positive_int, default=10, help="timed rounds (default: %(default)s)")
    common.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    common.add_argument("--malloc", choices=["retain", "system"], default="retain",
                        help="retain: every mode's process keeps freed memory for reuse instead of "
                             "page-faulting it in each step (spar_comm.retain_freed_memory); system: glibc's "
                             "own thresholds (default: %(default)s)")
    common.add_argument("--lr", type=positive_float, default=None,
                        help="learning rate (default: the workload's: SGD 1e-3 for mlp, AdamW 1e-3 for gpt, "
                             "SGD with momentum 0.05 for cnn)")
    common.add_argument("--eval-every", type=positive_int, default=None, metavar="ROUNDS",
                        help="gpt and cnn: measure every mode's held-out metric every ROUNDS rounds (warm-up "
                             "included) and report the training time to each of --targets")
    common.add_argument("--targets", type=comma_list(float, math.isfinite, "a finite number"), default=[],
                        help="comma-separated held-out metrics to reach: the gpt's validation loss, "
                             "the cnn's accuracy")
    common.add_argument("--peer-timeout", type=positive_float, default=120,
                        help="seconds a peer's step may take before the peer is failed (default: %(default)s)")
    common.add_argument("--out", help="write the results as JSON here")
    common.add_argument("--plot", help="draw ms per step by mode into this PNG")
    common.add_argument("--sync-every", type=positive_int, default=8, metavar="H",
                        help="the local-step modes' period: an outer step every H steps (default: %(default)s)")
    common.add_argument("--outer-density", type=density, default=None,
                        help="the sparse local-step modes' share of the pseudo-gradient sent (default: --density)")
    common.add_argument("--overlap-steps", type=positive_int, default=1, metavar="TAU",
                        help="the _overlap modes: the inner steps each outer reduction runs beside before its mean "
                             "is taken, 1 to --sync-every (default: %(default)s)")
    common.add_argument("--inject-failure", choices=PEERS, metavar="MODE",
                        help="make this peer's process abort on the last rank in its first timed step, "
                             "to show that a failing peer is reported and blocks nothing")
    parser = argparse.ArgumentParser(prog="bench_peers.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    models = parser.add_subparsers(dest="model", required=True, metavar="{mlp,gpt,cnn}")
    mlp = models.add_parser("mlp", parents=[common], help="an MLP on random data (17.3M parameters by default)")
    mlp.add_argument("--inputs", type=positive_int, default=256, help="(default: %(default)s)")
    mlp.add_argument("--hidden", type=positive_int, default=2048, help="(default: %(default)s)")
    mlp.add_argument("--layers", type=positive_int, default=4, help="hidden-to-hidden layers (default: %(default)s)")
    gpt = models.add_parser("gpt", parents=[common], help="drivers/train_gpt.py's GPT on its text")
    add_gpt_arguments(gpt)
    cnn = models.add_parser("cnn", parents=[common], help="drivers/train_cnn.py's ResNet on its digits")
    add_resnet_arguments(cnn)
    args = parser.parse_args(argv)
    torchrun = under_torchrun()
    args.modes = args.modes or list(UNDER_TORCHRUN if torchrun else MODES)
    outside = [mode for mode in args.modes if torchrun and mode not in UNDER_TORCHRUN]
    if outside:
        parser.error(f"--modes {','.join(outside)}: under torchrun only {', '.join(UNDER_TORCHRUN)} run (the "
                     "others need an MPI launch: mpiexec -n N python drivers/bench_peers.py ...)")
    workload = (functools.partial(gpt_workload, gpt_config(gpt, args)) if args.model == "gpt" else
                functools.partial(cnn_workload, args.width, args.image) if args.model == "cnn" else
                functools.partial(mlp_workload, args.inputs, args.hidden, args.layers))
    if args.model == "mlp" and args.eval_every:
        parser.error("--eval-every: the mlp trains on random data and has nothing held out")
    if args.targets and not args.eval_every:
        parser.error("--targets needs --eval-every")
    return args, workload


def output_problem(args: argparse.Namespace) -> Optional[str]:
    for flag, path in (("--out", args.out), ("--plot", args.plot)):
        if path and unwritable(path, flag):
            return unwritable(path, flag)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "--plot needs matplotlib"
    return None


def main() -> None:
    args, workload = parse_args()
    world = MPI.COMM_WORLD
    if under_torchrun():  # no peers to fork: torch's group may start now
        start_torch(args.peer_timeout)
        world = TorchComm.world()
    raise_if_any(world, output_problem(args) if world.rank == 0 else None)
    torch.set_num_threads(1)
    if args.malloc == "retain":  # before any peer is forked: they inherit it
        retain_freed_memory()
    topology = Topology(comm=world, ranks_per_node=args.ranks_per_node)
    settings = settings_from(args, PeerSettings)
    work = workload(args.batch_size, args.lr, args.seed, world.rank)
    results, parameters = measure(settings, topology, work, lambda line: print(line, flush=True))
    peak = max(world.allgather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)) / 1024
    if world.rank == 0:
        report(args, settings, world, topology, results, parameters, peak)
    if dist.is_initialized():
        sct.destroy_process_group()


def report(args: argparse.Namespace, settings: PeerSettings, world: MPI.Comm, topology: Topology, results: List[dict],
           parameters: int, peak_rss_mib: float) -> None:
    """Rank 0: the table, and the plot and JSON where asked. ``peak_rss_mib``
    is the largest rank's peak resident memory, every mode of its process
    together (the forked peers' not counted): a mode's own where it ran alone."""
    heading = title(args.model, parameters, topology.describe().split(";")[0], args.batch_size, settings,
                    args.malloc == "system")
    print(heading)
    print(table(results), flush=True)
    print(f"peak resident memory of a rank's process: {peak_rss_mib:,.0f} MiB (its modes together; "
          "forked peers apart)", flush=True)
    if args.plot:
        plot(results, heading, args.plot, args.targets)
    if args.out:
        document = dict(
            meta=meta("bench_peers", topology.hosts, model=args.model, world_size=world.size,
                      nodes=topology.num_nodes, topology=topology.describe()),
            benchmark="bench_peers", version=spar_comm.__version__, torch=torch.__version__,
            world_size=world.size, nodes=topology.num_nodes, topology=topology.describe(),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(), parameters=parameters,
            settings={k: v for k, v in vars(args).items() if k not in ("out", "plot")}, results=results,
            peak_rss_mib=peak_rss_mib,
        )
        write_json(args.out, document)


if __name__ == "__main__":
    run_main(main, "bench_peers.py")
