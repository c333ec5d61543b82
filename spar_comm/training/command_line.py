"""train.py's command line as a library: its parser and the TrainConfig its
arguments make, so that every program that runs train.py's workload
(drivers/train.py, drivers/bench_accuracy.py) parses the same flags the same way."""
from __future__ import annotations

import argparse
import os
import sys
from typing import NoReturn, Optional

from mpi4py import MPI

from ..collectives import ALGORITHMS, AUTO
from ..collectives.codecs import INDICES, VALUES
from ..memory import DEVICES
from ..topology import ENV_RANKS_PER_NODE
from .config import DATASETS, DENSITY_SCHEDULES, MODELS, SCHEDULES, TrainConfig

#: train.py's description (the first paragraph of its --help).
DESCRIPTION = "Data-parallel training with sparsified gradient allreduce: the command line\nof ``spar_comm.training``."
DEFAULTS = TrainConfig()


class RankZeroParser(argparse.ArgumentParser):
    """argparse whose errors print on rank 0 only; every rank exits with status 2."""

    def error(self, message: str) -> NoReturn:
        if MPI.COMM_WORLD.rank == 0:
            self.print_usage(sys.stderr)
            sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows defaults, except the unset ones (None), whose help says what happens."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return action.help if action.default is None else super()._get_help_string(action)


def make_parser() -> RankZeroParser:
    """train.py's parser: every TrainConfig setting a flag, defaults from TrainConfig()."""
    p = RankZeroParser(prog="train.py", description=DESCRIPTION, formatter_class=DefaultsFormatter)
    comm = p.add_argument_group("communication")
    comm.add_argument("--algorithm", default=DEFAULTS.algorithm, choices=[*ALGORITHMS, AUTO],
                      help="gradient allreduce; auto: the one the cost model predicts fastest")
    comm.add_argument("--selector", default=DEFAULTS.selector, help="top-k method of spar_comm.kernels")
    comm.add_argument("--density", type=float, default=DEFAULTS.density, help="fraction of gradient entries sent")
    comm.add_argument("--values", choices=[*VALUES, AUTO], help="the values on the wire (dense, hier_dense, topka, "
                      "hitopk, hitopk_leader; what they round away stays in the residual; auto: whichever of as "
                      "summed, float16 and int8 the cost model predicts fastest; default: as summed)")
    comm.add_argument("--rank", type=int, default=DEFAULTS.rank, help="PowerSGD's rank (--algorithm powersgd)")
    comm.add_argument("--indices", choices=INDICES, help="the positions of the pairs on the wire: auto takes int32, "
                      "16-bit gaps or a bitmap, whichever is smallest (default: int32)")
    comm.add_argument("--ranks-per-node", type=int,
                      help="emulate nodes of this many consecutive ranks; 0: real nodes, found by shared memory "
                      f"(default: ${ENV_RANKS_PER_NODE}, else 2 when the job runs on one host, else real nodes)")
    model = p.add_argument_group("model and data")
    model.add_argument("--model", default=DEFAULTS.model, choices=MODELS, help="cnn needs torch")
    model.add_argument("--dataset", default=DEFAULTS.dataset, choices=DATASETS, help="digits: held-out 20%%")
    model.add_argument("--hidden", type=int, default=DEFAULTS.hidden, help="MLP width (4096: ~17M parameters)")
    model.add_argument("--depth", type=int, default=DEFAULTS.depth, help="MLP hidden layers")
    model.add_argument("--dtype", default=DEFAULTS.dtype, choices=["float32", "float64"], help="of parameters and gradients")
    model.add_argument("--device", default=DEFAULTS.device, choices=DEVICES,
                       help="gpu: each rank on GPU (its place on its host) %% count (needs CuPy); gpu-simulator: the GPU path "
                       "on the CPU under numba-cuda's simulator (slow; set NUMBA_ENABLE_CUDASIM=1)")
    opt = p.add_argument_group("optimization")
    length = opt.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=int, help="default: 30 on digits, 1 on synthetic")
    length.add_argument("--steps", type=int, help="total optimizer steps (instead of --epochs)")
    opt.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="per rank")
    opt.add_argument("--lr", type=float, default=DEFAULTS.lr, help="peak learning rate")
    opt.add_argument("--momentum", type=float, default=DEFAULTS.momentum, help="SGD momentum")
    opt.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay, help="L2, applied after the allreduce")
    opt.add_argument("--warmup", type=int, default=DEFAULTS.warmup, help="steps of linear warm-up")
    opt.add_argument("--schedule", default=DEFAULTS.schedule, choices=SCHEDULES, help="after warm-up")
    opt.add_argument("--seed", type=int, default=DEFAULTS.seed, help="initial weights and data order")
    outer = p.add_argument_group("local steps (DiLoCo, SparseLoCo: spar_comm/outer.py)")
    outer.add_argument("--sync-every", type=int, default=DEFAULTS.sync_every, metavar="H",
                       help="take H steps on each rank alone, then reduce the change of the weights (the "
                            "pseudo-gradient) with --algorithm and take an outer step (0: reduce every step's "
                            "gradient; default: %(default)s)")
    outer.add_argument("--outer-lr", type=float, default=DEFAULTS.outer_lr,
                       help="the outer step's learning rate (default: %(default)s; DiLoCo takes 0.7)")
    outer.add_argument("--outer-momentum", type=float, default=DEFAULTS.outer_momentum,
                       help="the outer step's momentum (default: %(default)s, error feedback alone, as SparseLoCo; "
                            "DiLoCo takes 0.9 with periods of hundreds of steps)")
    outer.add_argument("--outer-nesterov", action=argparse.BooleanOptionalAction, default=DEFAULTS.outer_nesterov,
                       help="Nesterov's form of the outer momentum (DiLoCo's)")
    aids = p.add_argument_group("convergence aids at low density (Deep Gradient Compression; for sparse "
                                "algorithms, ignored by dense ones)")
    aids.add_argument("--momentum-correction", action=argparse.BooleanOptionalAction, default=DEFAULTS.momentum_correction,
                      help="each rank sends its local momentum-corrected velocity; the global step is then plain SGD")
    aids.add_argument("--momentum-masking", action=argparse.BooleanOptionalAction, default=DEFAULTS.momentum_masking,
                      help="clear the local velocity where the reduced update is non-zero (needs momentum correction; "
                           "damps momentum, so off unless the density is very low)")
    aids.add_argument("--density-schedule", default=DEFAULTS.density_schedule, choices=DENSITY_SCHEDULES,
                      help="fixed: --density throughout; warmup: DGC's warm-up (--density-warmup*); accordion: "
                           "--accordion-high in critical regimes, --density elsewhere (default: %(default)s)")
    aids.add_argument("--density-warmup", type=int, default=DEFAULTS.density_warmup, metavar="EPOCHS",
                      help="density falls exponentially from --density-warmup-start to --density over these epochs (0: off)")
    aids.add_argument("--density-warmup-start", type=float, default=DEFAULTS.density_warmup_start, help="density of the first epoch")
    aids.add_argument("--accordion-high", type=float, default=DEFAULTS.accordion_high, metavar="DENSITY",
                      help="Accordion's density in critical regimes (default: ten times --density, at most 1)")
    aids.add_argument("--accordion-eta", type=float, default=DEFAULTS.accordion_eta,
                      help="relative change of the epoch's update norm that marks a critical regime (default: %(default)s)")
    aids.add_argument("--clip-norm", type=float, default=DEFAULTS.clip_norm,
                      help="clip each rank's gradient to this norm / sqrt(ranks) before accumulation (0: off)")
    run = p.add_argument_group("trace, checkpoints and stopping")
    run.add_argument("--trace", default="runs/train.h5", help="HDF5 trace path ('' for none)")
    run.add_argument("--trace-every", type=int, default=DEFAULTS.trace_every, help="steps between appends")
    run.add_argument("--checkpoint", help="HDF5 checkpoint path, written at the end, on a stop and periodically")
    run.add_argument("--checkpoint-every", type=int, default=0, help="also save every this many steps "
                     "(instead of --checkpoint-period)")
    run.add_argument("--checkpoint-period", type=float, default=DEFAULTS.checkpoint_period, metavar="SECONDS",
                     help="also save every this many seconds of training, so that a fault costs at most one period "
                     "(0: off)")
    run.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    run.add_argument("--stop-after", type=int, help="stop with a checkpoint once this many steps are done")
    run.add_argument("--time-limit", type=float, help="stop with a checkpoint once training has run this many seconds")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def ranks_per_node(flag: Optional[int]) -> Optional[int]:
    """The emulated node size (None: real nodes). By default a job on one host
    emulates nodes of 2, so that the hierarchical algorithms have nodes to span;
    a job on several hosts uses its real nodes. Collective."""
    if flag is not None:
        return flag or None
    if os.environ.get(ENV_RANKS_PER_NODE):
        return None  # the Topology reads it
    local = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = local.size == MPI.COMM_WORLD.size
    local.Free()
    return 2 if one_host else None


def config_from(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of ``make_parser``'s arguments (collective: see ``ranks_per_node``)."""
    values = {key: value for key, value in vars(args).items() if key != "no_progress"}
    values["ranks_per_node"] = ranks_per_node(args.ranks_per_node)
    values["trace"] = args.trace or None
    return TrainConfig(progress=not args.no_progress, **values)
