#!/usr/bin/env python
"""spar_comm against what PyTorch users run today, on the same model, data and
ranks in one run.

Every mode holds its own replica of the model and its own optimizer; the
modes take their steps in turn (one step each, round after round), so a slow
spell of the machine hits all alike, and each round starts one mode later
than the last, so that no mode always follows the same one (on a shared
machine the mode that runs right after torch's peers is slowed). A step's
time is the slowest rank's; figures are medians of the timed rounds after
warm-up.

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
  no_comm            the same step with no communication: the floor

Under torchrun (no MPI launch) the modes over torch and no_comm run:

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
import itertools  # noqa: E402
import math  # noqa: E402
import multiprocessing  # noqa: E402
from multiprocessing.connection import Connection  # noqa: E402
from typing import Any, Callable, List, Optional, Tuple  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

import spar_comm  # noqa: E402
import spar_comm.torch as sct  # noqa: E402
from spar_comm import Topology, retain_freed_memory, waiting  # noqa: E402
from spar_comm.bench.peers import (MODES, OVER_TORCH, PEERS, PHASES, SPAR, SPINNING, UNDER_TORCHRUN,  # noqa: E402
                                   Runner, Workload, classify, held_out, learning_curve, over_mpi, phases_of)
from spar_comm.bench.record import meta  # noqa: E402
from spar_comm.bench.timing import rotated, slowest  # noqa: E402
from spar_comm.costmodel.peers import MIN_COMPRESSION_RATE, ddp_bytes  # noqa: E402
from spar_comm.kernels import SELECTORS  # noqa: E402
from spar_comm.cli import comma_list, density, positive_float, positive_int  # noqa: E402
from spar_comm.consensus import raise_if_any  # noqa: E402
from spar_comm.files import unwritable, write_json  # noqa: E402
from spar_comm.launch import run_main  # noqa: E402
from spar_comm.torch.process_group import init_methods, on_one_host  # noqa: E402
from spar_comm.torch.transport import TorchComm  # noqa: E402
from spar_comm.torch.world import launched  # noqa: E402
from spar_comm.workloads import gpt as gpt_workload, resnet  # noqa: E402
from spar_comm.workloads.command_line import add_gpt_arguments, add_resnet_arguments, gpt_config  # noqa: E402
from spar_comm.workloads.mlp import mlp  # noqa: E402

#: How long a peer's process may take to start (gloo's rendezvous, DDP's first broadcast).
STARTUP_SECONDS = 120


# -- arguments -------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
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
    if args.model == "gpt":
        gpt_config(gpt, args)
    if args.model == "mlp" and args.eval_every:
        parser.error("--eval-every: the mlp trains on random data and has nothing held out")
    if args.targets and not args.eval_every:
        parser.error("--targets needs --eval-every")
    return args


# -- the workload: a model, its batches, its loss, its optimizer, its held-out metric -----------------
#: The GPT's validation set: the same evenly spaced windows for every mode.
GPT_EVAL_BATCHES, GPT_EVAL_SEQUENCES = 16, 8


def workload(args: argparse.Namespace, rank: int) -> Workload:
    generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
    if args.model == "gpt":
        text, validation = gpt_workload.stdlib_text()
        batches = gpt_workload.validation_batches(validation, GPT_EVAL_BATCHES, GPT_EVAL_SEQUENCES, args.context)
        return Workload(lambda: gpt_workload.gpt(gpt_workload.GPTConfig(args.layers, args.width, args.heads, args.context), args.seed),
                        lambda: gpt_workload.random_batch(text, args.batch_size, args.context, generator),
                        lambda model, batch: model(*batch),
                        lambda params: torch.optim.AdamW(params, lr=args.lr or 1e-3, weight_decay=0.01),
                        held_out(lambda m: sum(m(x, y).item() for x, y in batches) / len(batches)),
                        "validation loss", lower_is_better=True)
    if args.model == "cnn":
        x, y, test_x, test_y = resnet.digits_images(args.image)

        def batch():
            picked = torch.randint(len(y), (args.batch_size,), generator=generator)
            return x[picked], y[picked]

        return Workload(lambda: resnet.resnet(args.width, seed=args.seed), batch, classify,
                        lambda params: torch.optim.SGD(params, lr=args.lr or 0.05, momentum=0.9, weight_decay=5e-4),
                        held_out(lambda m: (m(test_x).argmax(1) == test_y).float().mean().item()),
                        "held-out accuracy")
    x = torch.randn(args.batch_size, args.inputs, generator=generator)
    y = torch.randint(10, (args.batch_size,), generator=generator)
    return Workload(lambda: mlp(args.inputs, args.hidden, args.layers), lambda: (x, y), classify,
                    lambda params: torch.optim.SGD(params, lr=args.lr or 1e-3))


# -- the modes ---------------------------------------------------------------------------------
def build_ddp(mode: str, replica: torch.nn.Module, work: Workload, args: argparse.Namespace,
              topology: Topology) -> Runner:
    """DDP around ``replica`` on the default process group, with ``mode``'s hook (collective)."""
    cap = args.bucket_cap_mb
    if mode.startswith("ddp_powersgd_r") and args.powersgd_one_bucket:
        cap = max(cap, 1 + sum(p.numel() * p.element_size() for p in replica.parameters()) / 2**20)
    model = DistributedDataParallel(replica, bucket_cap_mb=cap)
    if mode == "ddp_fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif mode.startswith("ddp_powersgd_r"):
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(mode[len("ddp_powersgd_r"):]),
            start_powerSGD_iter=2, min_compression_rate=MIN_COMPRESSION_RATE, random_seed=args.seed)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif mode == "spar_hook":
        model.register_comm_hook(*sct.comm_hook("hitopk", args.density, selector=args.selector, topology=topology))
    return Runner(model, work.new_optimizer(model.parameters()), lambda: None)


def under_torchrun() -> bool:
    """Whether torchrun launched this job: each process an MPI world of one, in a job of several."""
    told = launched()
    return MPI.COMM_WORLD.size == 1 and told is not None and told.world_size != "1"


def start_torch(args: argparse.Namespace, comm: Any = None) -> None:
    """torch.distributed's default group, where it is not up yet: over ``comm``'s
    ranks (an MPI launch), or from torchrun's environment (collective)."""
    if not dist.is_initialized():
        sct.init_process_group("gloo", comm=comm, timeout=datetime.timedelta(seconds=args.peer_timeout))


def build(mode: str, replica: torch.nn.Module, work: Workload, args: argparse.Namespace,
          topology: Topology, over_torch: Callable[[], Topology]) -> Runner:
    """The runner of a mode that runs in this process (collective);
    ``over_torch`` gives the job's nodes over torch.distributed's group."""
    if mode == "no_comm":
        return Runner(replica, work.new_optimizer(replica.parameters()), lambda: 0.0)
    if mode in OVER_TORCH:
        mode, topology = over_mpi(mode), over_torch()
    if mode == "spar_hook":
        start_torch(args, topology.world if topology.transport == "mpi" else None)  # DDP's own group
        return build_ddp(mode, replica, work, args, topology)
    algorithm, values, indices = SPAR[mode]
    small = [name for name, p in replica.named_parameters() if p.numel() < (args.dense_below or 0)]
    opt = sct.DistributedOptimizer(work.new_optimizer(replica.parameters()), replica.named_parameters(),
                                   algorithm=algorithm, density=args.density, selector=args.selector,
                                   topology=topology,
                                   bucket_cap_mb=args.bucket_cap_mb, values=values, indices=indices, dense=small)
    chosen = ",".join(sorted({b.reducer.name for b in opt.buckets}))
    return Runner(replica, opt, lambda: float(sum(b.reducer.last["bytes_inter"] for b in opt.buckets)),
                  f"chose {chosen} ({opt.pricing.describe()})" if mode == "spar_auto" else "",
                  lambda: phases_of(opt), mode in SPINNING)


def describe(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"{type(error).__name__}: {first}"[:300]


def peer_main(conn: Connection, mode: str, init_method: str, rank: int, size: int, fail_at: Optional[int],
              args: argparse.Namespace, replica: torch.nn.Module, work: Workload) -> None:
    """A DDP mode in a process of its own, forked from a rank before it starts
    any thread. It takes a step when the rank sends ("step", batch) and
    measures the held-out metric on ("evaluate", None); None stops it. It
    answers ("ok", seconds or metric) or ("error", text). A crash or a hang
    here (gloo aborts the process on some collective mismatches) ends only it."""
    try:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size,
                                timeout=datetime.timedelta(seconds=args.peer_timeout))
        runner = build_ddp(mode, replica, work, args, None)
        conn.send(("ok", None))
    except Exception as error:  # noqa: BLE001 (handed to the rank)
        conn.send(("error", describe(error)))
        return
    steps = itertools.count()
    while (request := conn.recv()) is not None:
        kind, batch = request
        if kind == "step" and next(steps) == fail_at:
            os.abort()  # as gloo does on a mismatch
        try:
            figure = (runner.step(tuple(map(torch.from_numpy, batch)), work.loss) if kind == "step"
                      else runner.evaluate(work.metric))
            conn.send(("ok", figure))
        except Exception as error:  # noqa: BLE001
            conn.send(("error", describe(error)))


class Peer:
    """The rank's side of a ``peer_main`` process: its answers, waited for at
    most --peer-timeout."""

    phases = None  # torch's own modes: no breakdown of their communication

    def __init__(self, mode: str, init_method: str, world: MPI.Comm, args: argparse.Namespace,
                 replica: torch.nn.Module, work: Workload, sent: Optional[float]):
        fail_at = args.warmup if mode == args.inject_failure and world.rank == world.size - 1 else None
        self.conn, theirs = multiprocessing.get_context("fork").Pipe()
        self.process = multiprocessing.get_context("fork").Process(
            target=peer_main, args=(theirs, mode, init_method, world.rank, world.size, fail_at, args, replica, work),
            daemon=True)
        self.process.start()
        theirs.close()
        self.timeout, self.sent, self.note = args.peer_timeout, lambda: sent, ""

    def answer(self, timeout: Optional[float] = None) -> Optional[float]:
        """The next answer's figure, waited for at most ``timeout`` (default
        --peer-timeout); an exception for an error, a death or silence."""
        timeout = timeout or self.timeout
        if not self.conn.poll(timeout):
            raise TimeoutError(f"no answer within {timeout:g} s")
        try:
            status, figure = self.conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"its process died (exit code {self.process.exitcode})") from None
        if status != "ok":
            raise RuntimeError(figure)
        return figure

    def step(self, batch, loss: Callable) -> float:
        self.conn.send(("step", tuple(t.numpy() for t in batch)))
        return self.answer()

    def evaluate(self, metric: Callable[[torch.nn.Module], float]) -> float:
        """The peer's own workload's metric (``metric`` is the same, forked with it)."""
        self.conn.send(("evaluate", None))
        return self.answer()

    def close(self) -> None:
        """Stop it: politely where it still listens, else for good."""
        try:
            self.conn.send(None)
        except OSError:
            pass
        self.process.join(5)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def agreed_error(world: MPI.Comm, action: Callable[[], None]) -> Optional[str]:
    """Run ``action`` on every rank; every rank's error, the same on every
    rank, or None where all succeeded. The ranks agree in a wait that sleeps
    (see ``between_steps``)."""
    error = None
    try:
        action()
    except Exception as e:  # noqa: BLE001 (a peer's failure is a result, whatever it is)
        error = describe(e)
    failed = np.array([error is not None], dtype=np.int32)
    with waiting.watched("the agreement after a step", world, patient=True):  # a peer's step may be long
        waiting.collective(world, "Allreduce", MPI.IN_PLACE, failed, nbytes=failed.nbytes, op=MPI.SUM)
    if not failed[0]:
        return None
    errors = [f"rank {r}: {e}" for r, e in enumerate(world.allgather(error)) if e is not None]
    return "; ".join(errors)


def between_steps(world: MPI.Comm) -> None:
    """The barrier before each mode's step, in a wait that sleeps: a rank
    that spun in it would take the cores from the ranks still in their step
    where ranks outnumber cores (a step without communication, whose ranks
    never wait for one another, took 20 times its time beside spinning ranks)."""
    with waiting.watched("the barrier before a step", world, patient=True):  # the last step may be long
        waiting.collective(world, "Barrier")


# -- the measurement ---------------------------------------------------------------------------
def start_modes(args: argparse.Namespace, topology: Topology, work: Workload, results: dict) -> dict:
    """Every mode's runner (or Peer), in ``args.modes`` order; a mode that
    cannot start gets its error in ``results``. The peers' processes are
    forked first, before spar_comm starts its threads."""
    world = topology.world
    peers = [mode for mode in args.modes if mode in PEERS]
    started = {}
    methods = init_methods(world, len(peers), on_one_host(world)) if peers else []
    for mode, method in zip(peers, methods):
        replica = work.new_model()
        shapes = [tuple(p.shape) for p in replica.parameters() if p.requires_grad]
        sent = ddp_bytes(mode, shapes, world.size, topology.num_nodes)
        started[mode] = Peer(mode, method, world, args, replica, work, sent)
    made = {}

    def over_torch() -> Topology:
        """The job's nodes over torch.distributed's group, made at the first mode that asks (collective)."""
        if "topology" not in made:
            if topology.transport == "torch":
                made["topology"] = topology
            else:
                start_torch(args, world)
                made["topology"] = Topology(comm=TorchComm.world(), ranks_per_node=args.ranks_per_node)
        return made["topology"]

    runners = {}
    for mode in args.modes:
        def construct(mode=mode):
            if mode in started:
                started[mode].answer(max(STARTUP_SECONDS, args.peer_timeout))
                runners[mode] = started[mode]
            else:
                runners[mode] = build(mode, work.new_model(), work, args, topology, over_torch)
        error = agreed_error(world, construct)
        if error:
            results[mode].update(status="failed", error=error)
            if mode in started:
                started[mode].close()
    return runners


def fail(results: dict, runners: dict, mode: str, error: str) -> None:
    results[mode].update(status="failed", error=error)
    runner = runners.pop(mode)
    if isinstance(runner, Peer):
        runner.close()


def measure(args: argparse.Namespace, topology: Topology) -> Tuple[List[dict], int]:
    """One result per mode, in ``args.modes`` order, and the model's parameter
    count. Every round each mode takes one step on the same batch; with
    --eval-every, rank 0 measures each mode's held-out metric between rounds
    (not timed)."""
    world = topology.world
    work = workload(args, world.rank)
    results = {mode: dict(mode=mode, status="ok", error=None, note="") for mode in args.modes}
    runners = start_modes(args, topology, work, results)
    rounds = args.warmup + args.repeat
    seconds = np.zeros((len(args.modes), rounds))
    sent = np.zeros((len(args.modes), args.repeat))
    phases = np.full((len(args.modes), args.repeat, len(PHASES)), np.nan)
    evaluations = {mode: [] for mode in args.modes}  # rank 0: (round, metric)
    for i in range(rounds):
        batch = work.next_batch()
        for m in rotated(len(args.modes), i):
            mode = args.modes[m]
            runner = runners.get(mode)
            if runner is None:
                continue
            between_steps(world)
            elapsed = []
            error = agreed_error(world, lambda: elapsed.append(runner.step(batch, work.loss)))
            if error:
                fail(results, runners, mode, f"round {i + 1}: {error}")
                continue
            seconds[m, i] = elapsed[0]
            if i >= args.warmup:
                figure = runner.sent()
                sent[m, i - args.warmup] = np.nan if figure is None else figure
                if runner.phases is not None:
                    figures = runner.phases()
                    phases[m, i - args.warmup] = [figures[name] for name in PHASES]
        if args.eval_every and ((i + 1) % args.eval_every == 0 or i + 1 == rounds):
            for mode in [mode for mode in args.modes if mode in runners]:
                def evaluate(mode=mode):
                    if world.rank == 0:
                        evaluations[mode].append((i + 1, runners[mode].evaluate(work.metric)))
                error = agreed_error(world, evaluate)
                if error:
                    fail(results, runners, mode, f"evaluation after round {i + 1}: {error}")
            if world.rank == 0:  # progress
                print(f"round {i + 1}/{rounds}: " + ", ".join(f"{mode} {evaluations[mode][-1][1]:.4f}"
                                                             for mode in args.modes if mode in runners), flush=True)
        elif not args.eval_every and world.rank == 0 and (i + 1) % max(1, rounds // 10) == 0:
            print(f"round {i + 1}/{rounds}: {len(runners)} of {len(args.modes)} modes running", flush=True)
    for runner in runners.values():
        if isinstance(runner, Peer):
            runner.close()
    slowest_seconds = slowest(world, seconds)
    mean_sent = np.empty_like(sent)
    world.Allreduce(sent, mean_sent, op=MPI.SUM)
    mean_sent /= world.size
    slowest_phases = slowest(world, phases)  # each phase on its slowest rank
    for m, mode in enumerate(args.modes):
        if args.eval_every:
            results[mode].update(learning_curve(evaluations[mode], np.cumsum(slowest_seconds[m]), work, args.targets))
        if results[mode]["status"] == "ok":
            bytes_inter = float(np.median(mean_sent[m]))
            results[mode].update(step_ms=1e3 * float(np.median(slowest_seconds[m, args.warmup:])),
                                 bytes_inter=None if np.isnan(bytes_inter) else bytes_inter,
                                 note=runners[mode].note)
            if not np.isnan(slowest_phases[m]).any():
                medians = 1e3 * np.median(slowest_phases[m], axis=0)
                results[mode]["phases_ms"] = {name: float(ms) for name, ms in zip(PHASES, medians)}
    ddp = results.get("ddp", {})
    for result in results.values():
        if "step_ms" in result:
            result["ratio_to_ddp"] = result["step_ms"] / ddp["step_ms"] if ddp.get("step_ms") else None
        for reached, ddps in zip(result.get("to_target", []), ddp.get("to_target", [])):
            if reached["seconds"] is not None:
                reached["ratio_to_ddp"] = reached["seconds"] / ddps["seconds"] if ddps["seconds"] else None
    parameters = sum(p.numel() for p in work.new_model().parameters())
    return [results[mode] for mode in args.modes], parameters


# -- output ------------------------------------------------------------------------------------
def table(results: List[dict]) -> str:
    w = max(18, 2 + max(len(r["mode"]) for r in results))  # the mode column
    lines = [f"{'mode':<{w}}{'ms/step':>10}{'x DDP':>8}{'MB between nodes':>18}  note"]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"{r['mode']:<{w}}{r['status']:>10}{'':>8}{'':>18}  {r['error']}")
            continue
        ratio = f"{r['ratio_to_ddp']:.2f}" if r.get("ratio_to_ddp") else "-"
        sent = f"{r['bytes_inter'] / 1e6:.4g}" if r["bytes_inter"] is not None else "unknown"
        lines.append(f"{r['mode']:<{w}}{r['step_ms']:>10.1f}{ratio:>8}{sent:>18}  {r['note']}")
    timed = [r for r in results if "phases_ms" in r]
    if timed:
        lines += ["", "where spar_comm's communication went, ms (medians, each phase on its slowest rank):",
                  f"{'mode':<{w}}" + "".join(f"{name:>9}" for name in PHASES)]
        lines += [f"{r['mode']:<{w}}" + "".join(f"{r['phases_ms'][name]:>9.1f}" for name in PHASES) for r in timed]
    curves = [r for r in results if r.get("curve")]
    if curves:
        lines += ["", f"time to target: s of training (the slowest rank's steps summed) until the "
                      f"{curves[0]['metric']} first reached each target, steps in brackets:",
                  f"{'mode':<{w}}" + "".join(f"{'to ' + format(t['target'], 'g'):>20}" for t in curves[0]["to_target"])
                  + f"{'final':>10}{'after':>8}"]
        for r in curves:
            cells = [f"{t['seconds']:.1f} ({t['steps']}) {t['ratio_to_ddp']:.2f}x" if t.get("ratio_to_ddp")
                     else f"{t['seconds']:.1f} ({t['steps']})" if t["seconds"] is not None else "not reached"
                     for t in r["to_target"]]
            lines.append(f"{r['mode']:<{w}}" + "".join(f"{c:>20}" for c in cells)
                         + f"{r['curve'][-1][2]:>10.4f}{r['curve'][-1][0]:>8}")
    return "\n".join(lines)


def plot(results: List[dict], title: str, path: str, targets: List[float]) -> None:
    """ms per step by mode; beside it, where measured, each mode's held-out
    metric against its training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [r for r in results if r.get("curve")]
    fig, axes = plt.subplots(1, 2 if curves else 1, squeeze=False,
                             figsize=(14 if curves else 8, 0.35 * len(results) + 2.5))
    ax = axes[0, 0]
    names = [r["mode"] for r in results][::-1]
    values = [r.get("step_ms", 0.0) for r in results][::-1]
    bars = ax.barh(names, values, color=["tab:blue" if n.startswith("spar_") else "tab:gray" for n in names])
    for bar, r in zip(bars, results[::-1]):
        if r["status"] != "ok":
            ax.text(0, bar.get_y() + bar.get_height() / 2, f" {r['status']}", va="center", color="tab:red")
    ax.set_xlabel("ms per step (slowest rank, median)")
    ax.set_title(title.replace("; ", "\n", 1), fontsize=9)
    if curves:
        ax = axes[0, 1]
        for r in curves:
            points = np.array(r["curve"])
            ax.plot(points[:, 1], points[:, 2], marker=".", label=r["mode"],
                    linestyle="-" if r["mode"].startswith("spar_") else "--")
        for target in targets:
            ax.axhline(target, color="black", linewidth=0.8, linestyle=":")
        ax.set_xlabel("s of training (the slowest rank's steps summed)")
        ax.set_ylabel(curves[0]["metric"])
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


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
    args = parse_args()
    world = MPI.COMM_WORLD
    if under_torchrun():  # no peers to fork: torch's group may start now
        start_torch(args)
        world = TorchComm.world()
    raise_if_any(world, output_problem(args) if world.rank == 0 else None)
    torch.set_num_threads(1)
    if args.malloc == "retain":  # before any peer is forked: they inherit it
        retain_freed_memory()
    topology = Topology(comm=world, ranks_per_node=args.ranks_per_node)
    results, parameters = measure(args, topology)
    if world.rank == 0:
        report(args, world, topology, results, parameters)
    if dist.is_initialized():
        sct.destroy_process_group()


def report(args: argparse.Namespace, world: MPI.Comm, topology: Topology, results: List[dict],
           parameters: int) -> None:
    """Rank 0: the table, and the plot and JSON where asked."""
    title = (f"{args.model}, {parameters:,} parameters; {topology.describe().split(';')[0]}; "
             f"batch {args.batch_size} per rank; median of {args.repeat}; spar_comm: {args.selector} at density "
             f"{args.density:g}" + (f", parameters below {args.dense_below:,} dense" if args.dense_below else "")
             + ("; glibc's own malloc thresholds" if args.malloc == "system" else ""))
    print(title)
    print(table(results), flush=True)
    if args.plot:
        plot(results, title, args.plot, args.targets)
    if args.out:
        document = dict(
            meta=meta("bench_peers", topology.hosts, model=args.model, world_size=world.size,
                      nodes=topology.num_nodes, topology=topology.describe()),
            benchmark="bench_peers", version=spar_comm.__version__, torch=torch.__version__,
            world_size=world.size, nodes=topology.num_nodes, topology=topology.describe(),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(), parameters=parameters,
            settings={k: v for k, v in vars(args).items() if k not in ("out", "plot")}, results=results,
        )
        write_json(args.out, document)


if __name__ == "__main__":
    run_main(main, "bench_peers.py")
