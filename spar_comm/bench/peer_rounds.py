"""bench_peers.py's measurement: every mode takes one step a round on the
same batch, in an order that starts one mode later each round, behind a
barrier that sleeps; a step's time is the slowest rank's. A mode that fails
on any rank is failed on every rank alike, and the others go on."""
from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..costmodel.peers import ddp_bytes
from ..topology import Topology
from ..torch.process_group import init_methods, on_one_host
from ..torch.transport import TorchComm
from .peer_process import Peer
from .peer_runners import build, start_torch
from .peers import PEERS, PHASES, PeerSettings, Workload, describe, learning_curve
from .timing import rotated, slowest

#: How long a peer's process may take to start (gloo's rendezvous, DDP's first broadcast).
STARTUP_SECONDS = 120


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


def start_modes(settings: PeerSettings, topology: Topology, work: Workload, results: dict) -> dict:
    """Every mode's runner (or Peer), in ``settings.modes`` order; a mode that
    cannot start gets its error in ``results``. The peers' processes are
    forked first, before spar_comm starts its threads."""
    world = topology.world
    peers = [mode for mode in settings.modes if mode in PEERS]
    started = {}
    methods = init_methods(world, len(peers), on_one_host(world)) if peers else []
    for mode, method in zip(peers, methods):
        replica = work.new_model()
        shapes = [tuple(p.shape) for p in replica.parameters() if p.requires_grad]
        sent = ddp_bytes(mode, shapes, world.size, topology.num_nodes)
        started[mode] = Peer(mode, method, world, settings, replica, work, sent)
    made = {}

    def over_torch() -> Topology:
        """The job's nodes over torch.distributed's group, made at the first mode that asks (collective)."""
        if "topology" not in made:
            if topology.transport == "torch":
                made["topology"] = topology
            else:
                start_torch(settings.peer_timeout, world)
                made["topology"] = Topology(comm=TorchComm.world(), ranks_per_node=settings.ranks_per_node)
        return made["topology"]

    runners = {}
    for mode in settings.modes:
        def construct(mode=mode):
            if mode in started:
                started[mode].answer(max(STARTUP_SECONDS, settings.peer_timeout))
                runners[mode] = started[mode]
            else:
                runners[mode] = build(mode, work.new_model(), work, settings, topology, over_torch)
        error = agreed_error(world, construct)
        if error:
            results[mode].update(status="failed", error=error)
            if mode in started:
                started[mode].close()
    return runners


def fail(results: dict, runners: dict, mode: str, error: str) -> None:
    """Mark ``mode`` failed with ``error`` and stop its runner: the rounds go on without it."""
    results[mode].update(status="failed", error=error)
    runner = runners.pop(mode)
    if isinstance(runner, Peer):
        runner.close()


def measure(settings: PeerSettings, topology: Topology, work: Workload,
            progress: Callable[[str], None]) -> Tuple[List[dict], int]:
    """One result per mode, in ``settings.modes`` order, and the model's
    parameter count (collective). Every round each mode takes one step on the
    same batch; with ``settings.eval_every``, rank 0 measures each mode's
    held-out metric between rounds (not timed). Rank 0 tells ``progress``
    how far the rounds are."""
    world = topology.world
    results = {mode: dict(mode=mode, status="ok", error=None, note="") for mode in settings.modes}
    runners = start_modes(settings, topology, work, results)
    rounds = settings.warmup + settings.repeat
    seconds = np.zeros((len(settings.modes), rounds))
    sent = np.zeros((len(settings.modes), settings.repeat))
    phases = np.full((len(settings.modes), settings.repeat, len(PHASES)), np.nan)
    evaluations = {mode: [] for mode in settings.modes}  # rank 0: (round, metric)
    for i in range(rounds):
        batch = work.next_batch()
        for m in rotated(len(settings.modes), i):
            mode = settings.modes[m]
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
            if i >= settings.warmup:
                figure = runner.sent()
                sent[m, i - settings.warmup] = np.nan if figure is None else figure
                if runner.phases is not None:
                    figures = runner.phases()
                    phases[m, i - settings.warmup] = [figures[name] for name in PHASES]
        if settings.eval_every and ((i + 1) % settings.eval_every == 0 or i + 1 == rounds):
            for mode in [mode for mode in settings.modes if mode in runners]:
                def evaluate(mode=mode):
                    runner = runners[mode]
                    if world.rank == 0 or runner.collective:
                        value = runner.evaluate(work.metric)
                        if world.rank == 0:
                            evaluations[mode].append((i + 1, value))
                error = agreed_error(world, evaluate)
                if error:
                    fail(results, runners, mode, f"evaluation after round {i + 1}: {error}")
            if world.rank == 0:  # progress
                progress(f"round {i + 1}/{rounds}: " + ", ".join(f"{mode} {evaluations[mode][-1][1]:.4f}"
                                                                for mode in settings.modes if mode in runners))
        elif not settings.eval_every and world.rank == 0 and (i + 1) % max(1, rounds // 10) == 0:
            progress(f"round {i + 1}/{rounds}: {len(runners)} of {len(settings.modes)} modes running")
    for runner in runners.values():
        if isinstance(runner, Peer):
            runner.close()
    slowest_seconds = slowest(world, seconds)
    mean_sent = np.empty_like(sent)
    world.Allreduce(sent, mean_sent, op=MPI.SUM)
    mean_sent /= world.size
    slowest_phases = slowest(world, phases)  # each phase on its slowest rank
    for m, mode in enumerate(settings.modes):
        if settings.eval_every:
            results[mode].update(learning_curve(evaluations[mode], np.cumsum(slowest_seconds[m]), work,
                                                settings.targets))
        if results[mode]["status"] == "ok":
            bytes_inter = float(np.mean(mean_sent[m]))  # the mean: a local-step mode sends every H steps
            timed = slowest_seconds[m, settings.warmup:]
            results[mode].update(step_ms=1e3 * float(np.median(timed)), step_ms_mean=1e3 * float(np.mean(timed)),
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
    return [results[mode] for mode in settings.modes], parameters
