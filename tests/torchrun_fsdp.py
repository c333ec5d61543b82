"""Run by ``tests/test_torchrun.py`` under torchrun on emulated nodes
(``SPAR_COMM_RANKS_PER_NODE``): FSDP2 sharded inside each node, its shards
reduced between nodes by ``spar_comm.torch.hsdp_hook``, against torch's own
HSDP (the 2-D mesh) on the same model and data.

The model's sizes do not divide by the node's ranks (FSDP pads the shards),
and the root holds a parameter of its own (its hook is called too). Cases:
``dense`` ends on torch's HSDP parameters (plain, force-sum with and without
a divide factor, accumulation both ways, mixed precision with fp32 and bf16
reduction); ``topka``, ``gtopk``, ``topka`` with int8 values and coded
indices, and ``auto`` conserve per shard (replicas times what was applied,
plus the replicas' residuals, is the sum of the node means handed to the
hook, a codec's rounding kept in the residual), leave every replica the same
shards and keep a residual of a shard's elements (gradients chosen to sum
exactly, so that where the replicas and the node's ranks are powers of two
the check is to the bit; elsewhere to float32's rounding of the node means);
``auto`` chooses for each module alike on every rank (dense for a small one, topka for a large one);
``hitopk`` runs ``topka`` and ``hier_dense`` runs ``dense``; an Inf on one
rank is a NaN group on every rank with the residuals kept; a save resumes to
the same bits, and on 3 nodes of 2 a save of 2 nodes of 2 (the launches'
shared directory, ``SPAR_COMM_TEST_HSDP_CHECKPOINT``) keeps each shard's
residual total to the bit, where nodes of 3 refuse it; a wrong mesh, a divide factor gloo cannot run, and
``hitopk_leader``, ``adasum`` and ``powersgd`` are refused on every rank with
the same ConfigError, saying why.
Prints ``rank R: FAILURES failed`` and each failure."""
from __future__ import annotations

import functools
import os
import shutil
import tempfile
import traceback
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.state_dict as dcp_state
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import spar_comm.torch as sct
from spar_comm import ConfigError
from spar_comm.costmodel import calibrate
from spar_comm.costmodel.auto import ENV_CALIBRATION
from spar_comm.costmodel.machine import CPU
from torchrun_helpers import report, say

STEPS = 3


class Net(torch.nn.Module):
    """Two layers whose sizes no node of 2 or 3 ranks divides, and a root parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.first, self.second = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)
        self.gain = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return (self.second(torch.relu(self.first(x))) * self.gain).square().sum()


class Pair(torch.nn.Module):
    """loss = sum(w * g) + sum(v * h): the gradients are the g and h handed in."""

    def __init__(self, rows: int, columns: int):
        super().__init__()
        self.w, self.v = torch.nn.Parameter(torch.zeros(rows, columns)), torch.nn.Parameter(torch.zeros(rows))

    def forward(self, g, h):
        return (self.w * g).sum() + (self.v * h).sum()


class Chosen(torch.nn.Module):
    """Net's shapes (or a ``first`` pair of other ones) with gradients chosen:
    multiples of 2**-6 that sum exactly."""

    def __init__(self, first: Tuple[int, int] = (7, 5)):
        super().__init__()
        self.first, self.second = Pair(*first), Pair(3, 7)
        self.gain = torch.nn.Parameter(torch.zeros(3))

    def forward(self, grads):
        return self.first(*grads[:2]) + self.second(*grads[2:4]) + (self.gain * grads[4]).sum()


def chosen_grads(step: int, first: Tuple[int, int] = (7, 5)) -> List[torch.Tensor]:
    rng = np.random.default_rng([7, step, dist.get_rank()])
    return [torch.from_numpy(rng.integers(-(2**10), 2**10, shape) * 2.0**-6).float()
            for shape in [first, first[:1], (3, 7), (3,), (3,)]]


def sharded(mesh, mp: Optional[MixedPrecisionPolicy] = None, factor: Optional[float] = None,
            force_sum: bool = False, model: Optional[torch.nn.Module] = None) -> torch.nn.Module:
    model = Net() if model is None else model
    for module in (model.first, model.second, model):
        fully_shard(module, mesh=mesh, **({"mp_policy": mp} if mp else {}))
        if factor is not None:
            module.set_gradient_divide_factor(factor)
        if force_sum:
            module.set_force_sum_reduction_for_comms(True)
    return model


def batch(step: int, micro: int = 0) -> torch.Tensor:
    """This rank's input: multiples of 1/8, different on every rank and step."""
    g = torch.Generator().manual_seed(1000 * dist.get_rank() + 10 * step + micro)
    return torch.randint(-8, 9, (4, 5), generator=g).float() / 8


def train(model: Net, steps: int = STEPS, micro: int = 1, switch: str = "all_reduce", first: int = 0) -> None:
    """SGD; ``micro`` backward passes a step, those before the last with
    ``set_requires_all_reduce(False)`` or ``set_requires_gradient_sync(False)``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(first, first + steps):
        optimizer.zero_grad()
        for m in range(micro):
            last = m == micro - 1
            getattr(model, f"set_requires_{switch}" if switch == "all_reduce" else "set_requires_gradient_sync")(last)
            model(batch(step, m)).backward()
        optimizer.step()


def full(model: Net) -> List[torch.Tensor]:
    return [p.full_tensor().detach().float() for p in model.parameters()]


def recorded(model: Net) -> Dict[str, List]:
    """What each FSDP module's hook is handed and leaves, a call at a time (wraps the hooks hsdp_hook set)."""
    calls: Dict[str, List] = {}
    for name, module in model.named_modules():
        groups = getattr(module, "_get_fsdp_state", lambda: None)()
        if groups is None or not groups._fsdp_param_groups:
            continue
        hook = groups._fsdp_param_groups[0]._all_reduce_hook

        def recorder(t, hook=hook, name=name):
            given = t.detach().double().clone()
            hook(t)
            calls.setdefault(name, []).append((given, t.detach().double().clone()))

        module.set_all_reduce_hook(recorder)
    return calls


def same_on_all(value, group=None) -> bool:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return all(v == out[0] for v in out)


def check_close(name: str, got: List[torch.Tensor], expected: List[torch.Tensor], failures: list,
                atol: float = 1e-6) -> None:
    worst = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    if not worst <= atol:
        failures.append(f"{name}: {worst:.3g} from torch's HSDP")


def native_and_hook(mesh, failures: list, name: str, atol: float = 1e-6, transport: Optional[str] = None,
                    **how) -> None:
    """The same training under torch's HSDP and under the dense hook (over
    ``transport``): the same parameters."""
    build = {key: how.pop(key) for key in ("mp", "factor", "force_sum") if key in how}
    native = sharded(mesh, **build)
    train(native, **how)
    mine = sharded(mesh["shard"], **build)
    sct.hsdp_hook(mine, "dense", mesh=mesh, transport=transport)
    calls = recorded(mine)
    train(mine, **how)
    check_close(name, full(mine), full(native), failures, atol)
    if how.get("switch") == "gradient_sync" and sum(len(c) for c in calls.values()) != 3 * how.get("steps", STEPS):
        failures.append(f"{name}: the hook was called on micro-steps without gradient sync")


def conserves(mesh, failures: list, algorithm: str, atol: float = 1e-5, first: Tuple[int, int] = (7, 5),
              density: float = 0.3, **settings) -> Dict[str, str]:
    """Conservation per shard (replicas times what was applied, plus the
    replicas' residuals, is the sum of the node means handed to the hook:
    a codec's rounding stays in the residual), the same shards on every
    replica, a shard's residual. Returns the algorithm each module's
    allreducer runs."""
    model = sharded(mesh["shard"], model=Chosen(first))
    state = sct.hsdp_hook(model, algorithm, density=density, mesh=mesh, **settings)
    calls = recorded(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(STEPS):
        optimizer.zero_grad()
        model(chosen_grads(step, first)).backward()
        optimizer.step()
    replicas = mesh["rep"].get_group()
    r, g = mesh["rep"].size(), mesh["shard"].size()
    exact = (r & (r - 1)) == 0 and (g & (g - 1)) == 0 and not settings  # no rounding in the node mean, the divide
    case = " ".join([algorithm, *map(str, settings.values())])
    for name, made in calls.items():
        given = sum(g for g, _ in made)
        applied = sum(a for _, a in made)
        reducer = state.shards[name].reducer
        residual = torch.zeros_like(given)
        if reducer.keeps_residual:
            residual = torch.from_numpy(reducer.residual_full().astype(np.float64))
            if residual.numel() != given.numel() or reducer.feedback.residual.size > given.numel():
                failures.append(f"{case} {name!r}: a residual of {residual.numel()} values for a shard of "
                                f"{given.numel()}")
        total, raw = applied * r, given.clone()
        dist.all_reduce(raw, group=replicas)
        dist.all_reduce(residual, group=replicas)
        total += residual
        if not (torch.equal(total, raw) if exact else torch.allclose(total, raw, rtol=0, atol=atol)):
            failures.append(f"{case} {name!r}: replicas x applied + residuals is not the sum of the node means "
                            f"({float((total - raw).abs().max()):.3g})")
        if not same_on_all(applied.numpy().tobytes(), replicas):
            failures.append(f"{case} {name!r}: the replicas applied different shards")
    mine = b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())
    if not same_on_all(mine, replicas):
        failures.append(f"{case}: the replicas hold different parameter shards")
    say_sizes.update({name: made[0][0].numel() for name, made in calls.items()})
    return {name: shard.reducer.name for name, shard in state.shards.items()}


def chooses(mesh, failures: list) -> None:
    """``auto``: each module's own choice among dense, topka and gtopk, the
    same on every rank, and its reduction conserves. Priced from a
    calibration of 1 Gbit/s between nodes (no link timed, so the choice is
    known), at density 0.01: dense for the shards of a few values, topka for
    the first module's of 512 x 256 (the cost model's crossover lies between)."""
    calibration = os.path.join(tempfile.gettempdir(), f"spar_comm_fsdp_auto_{os.getpid()}.json")
    calibrate.save(calibration, CPU.replace(beta_inter=8e-9), [], [])
    os.environ[ENV_CALIBRATION] = calibration
    try:
        chosen = conserves(mesh, failures, "auto", first=(512, 256), density=0.01)
    finally:
        del os.environ[ENV_CALIBRATION]
        os.remove(calibration)
    if chosen != {"": "dense", "first": "topka", "second": "dense"}:
        failures.append(f"auto: chose {chosen}")
    if not same_on_all(chosen):
        failures.append(f"auto: the ranks chose differently ({chosen} here)")
    if dist.get_rank() == 0:
        say(f"rank 0: auto chose {chosen}")


def taken_as(mesh, failures: list, algorithm: str, runs: str) -> None:
    """``algorithm`` is ``runs`` on a replica group of one rank a node."""
    model = sharded(mesh["shard"])
    state = sct.hsdp_hook(model, algorithm, density=0.3, mesh=mesh)
    train(model, steps=1)
    names = {shard.reducer.name for shard in state.shards.values()}
    if state.algorithm != runs or names != {runs}:
        failures.append(f"{algorithm}: runs {state.algorithm}, allreducers {names}, not {runs}")


say_sizes: Dict[str, int] = {}


def overflow(mesh, failures: list) -> None:
    """An Inf in the last rank's input: the first layer's group NaN on every
    rank, and every residual as the step found it (GradScaler's skip)."""
    model = sharded(mesh["shard"])
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    state = sct.hsdp_hook(model, "topka", density=0.3, mesh=mesh, grad_scaler=scaler)
    train(model, steps=1)
    before = {name: shard.reducer.residual_full().copy() for name, shard in state.shards.items()}
    x = batch(5)
    if dist.get_rank() == dist.get_world_size() - 1:
        x[0, 0] = float("inf")
    model.zero_grad()
    model(x).backward()
    if not torch.isnan(model.first.weight.grad.to_local()).all():
        failures.append("overflow: the first layer's gradient is not NaN on this rank")
    for name, shard in state.shards.items():
        if not np.array_equal(shard.reducer.residual_full(), before[name]):
            failures.append(f"overflow: the residual of {name!r} changed")


def resume(mesh, failures: list) -> None:
    """Two steps, a save, two more; a fresh job loads the save and takes the
    same two steps: the same parameters to the bit."""
    directory = [tempfile.mkdtemp(prefix="spar_comm_hsdp_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)

    def job():
        model = sharded(mesh["shard"])
        state = sct.hsdp_hook(model, "topka", density=0.3, mesh=mesh)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        return model, state, optimizer, {"train": Trained(model, optimizer), "hsdp": state}

    def steps(model, optimizer, first):
        for step in range(first, first + 2):
            optimizer.zero_grad()
            model(batch(step)).backward()
            optimizer.step()

    model, state, optimizer, saved = job()
    steps(model, optimizer, 0)
    sct.save_checkpoint(saved, directory[0], 2)
    steps(model, optimizer, 2)
    model2, state2, optimizer2, saved2 = job()
    sct.load_checkpoint(saved2, directory[0])
    steps(model2, optimizer2, 2)
    if not all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), model2.parameters())):
        failures.append("resume: the resumed run's parameters differ from the run that never stopped")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(directory[0], ignore_errors=True)


#: The directory that test_torchrun.py's launches share: 2 nodes of 2 save there, 3 nodes of 2 and 2 of 3 resume.
ELSEWHERE = "SPAR_COMM_TEST_HSDP_CHECKPOINT"


def elsewhere(mesh, failures: list) -> None:
    """A save on 2 nodes of 2 (two steps of ``topka``, with the shards'
    residual totals and the parameters beside it) resumed on 3 nodes of 2:
    the parameters, and each shard's residual total over the replicas, to
    the bit; then a step. On nodes of 3 ranks the resume is refused alike."""
    directory = os.environ.get(ELSEWHERE)
    if not directory:
        return
    model = sharded(mesh["shard"], model=Chosen())
    state = sct.hsdp_hook(model, "topka", density=0.3, mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    saved = {"train": Trained(model, optimizer), "hsdp": state}
    reference = os.path.join(directory, "reference.npz")
    layout = tuple(mesh.mesh.shape)
    if layout == (2, 2):
        for step in range(2):
            optimizer.zero_grad()
            model(chosen_grads(step)).backward()
            optimizer.step()
        sct.save_checkpoint(saved, directory, 2)
        totals, parameters = residual_totals(state), full(model)
        if dist.get_rank() == 0:
            np.savez(reference, parameters=np.concatenate([p.flatten().numpy() for p in parameters]), **totals)
    elif layout[1] == 3 and os.path.exists(reference):
        refused("resume on nodes of 3", "saved on nodes of 2 ranks; this job's nodes have 3",
                lambda: sct.load_checkpoint(saved, directory), failures)
    elif os.path.exists(reference):
        resumed = sct.load_checkpoint(saved, directory)
        with np.load(reference) as kept:
            expected = dict(kept)
        got = np.concatenate([p.flatten().numpy() for p in full(model)])
        if (resumed.saved_world, resumed.world) != (4, dist.get_world_size()) or \
                not np.array_equal(got, expected.pop("parameters")):
            failures.append(f"resume elsewhere: {resumed}, parameters equal: {np.array_equal(got, expected)}")
        totals = residual_totals(state)
        if totals.keys() != expected.keys() or not all(np.array_equal(totals[k], expected[k]) for k in totals):
            failures.append(f"resume elsewhere: the residual totals by shard changed ({sorted(totals)}, "
                            f"saved {sorted(expected)})")
        model(chosen_grads(2)).backward()
        mine = b"".join(p.grad.to_local().numpy().tobytes() for p in model.parameters())
        if not same_on_all(mine, mesh["rep"].get_group()):
            failures.append("resume elsewhere: the replicas' gradients differ after the resume")


def residual_totals(state) -> Dict[str, np.ndarray]:
    """Every rank's residuals (``state_dict()``'s) totalled over the job by
    module and shard, in float64 (exact for the chosen gradients)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, [(name, shard, values.numpy().astype(np.float64))
                                      for name, shard, _, _, values in state.state_dict()["residuals"][
                                          f"rank{dist.get_rank()}"]])
    totals: Dict[str, np.ndarray] = {}
    for entries in everyone:
        for name, shard, values in entries:
            key = f"{name or 'root'}.shard{shard}"
            totals[key] = totals.get(key, 0) + values
    return totals


class Trained:
    """The sharded model's and optimizer's state, through torch's helpers."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self):
        model, optimizer = dcp_state.get_state_dict(self.model, self.optimizer)
        return {"model": model, "optimizer": optimizer}

    def load_state_dict(self, state):
        dcp_state.set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                                 optim_state_dict=state["optimizer"])


def refused(what: str, expected: str, call: Callable, failures: list) -> None:
    """``call`` raises ConfigError naming ``expected``, the same on every rank."""
    try:
        call()
        message = "(nothing raised)"
    except ConfigError as error:
        message = str(error)
    if expected not in message:
        failures.append(f"{what}: {message}")
    if not same_on_all(message):
        failures.append(f"{what}: the ranks raised different errors")


#: The algorithms hsdp_hook refuses, and words of the reason each must give.
NOT_APPLICABLE = {"hitopk_leader": "one rank a node: nothing is gathered", "adasum": "not the mean",
                  "powersgd": "factors each parameter's matrix"}


def refuses(mesh, failures: list, algorithm: str, why: str) -> None:
    """``algorithm`` refused on every rank alike, saying why."""
    refused(f"{algorithm} refused", why, lambda: sct.hsdp_hook(sharded(mesh["shard"]), algorithm, mesh=mesh),
            failures)


def main() -> None:
    sct.init_process_group("gloo")
    mesh = sct.node_mesh()
    failures: list = []
    cases = {
        "dense": lambda: native_and_hook(mesh, failures, "dense"),
        "force-sum": lambda: native_and_hook(mesh, failures, "force-sum", force_sum=True),
        "force-sum, factor": lambda: native_and_hook(mesh, failures, "force-sum, factor", force_sum=True,
                                                     factor=float(dist.get_world_size())),
        "accumulation, all-reduce off": lambda: native_and_hook(mesh, failures, "accumulation, all-reduce off",
                                                                micro=3),
        "accumulation, sync off": lambda: native_and_hook(mesh, failures, "accumulation, sync off", micro=3,
                                                          switch="gradient_sync"),
        "bf16, fp32 reduction": lambda: native_and_hook(
            mesh, failures, "bf16, fp32 reduction", atol=1e-3,
            mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)),
        "bf16, bf16 reduction": lambda: native_and_hook(
            mesh, failures, "bf16, bf16 reduction", atol=1e-3, mp=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
        "topka": lambda: conserves(mesh, failures, "topka"),
        "gtopk": lambda: conserves(mesh, failures, "gtopk"),
        "topka, int8 values": lambda: conserves(mesh, failures, "topka", atol=1e-4, values="int8", indices="auto"),
        "auto": lambda: chooses(mesh, failures),
        "hitopk": lambda: taken_as(mesh, failures, "hitopk", "topka"),
        "hier_dense": lambda: taken_as(mesh, failures, "hier_dense", "dense"),
        "overflow": lambda: overflow(mesh, failures),
        "resume": lambda: resume(mesh, failures),
        "resume elsewhere": lambda: elsewhere(mesh, failures),
        "wrong mesh": lambda: refused(
            "wrong mesh", "replica group in the mesh",
            lambda: sct.hsdp_hook(sharded(mesh["shard"]), "topka", mesh=DeviceMesh(
                "cpu", mesh.mesh, mesh_dim_names=("shard", "rep"))), failures),
        "premul factor": lambda: refused(
            "premul factor", "PREMUL_SUM", lambda: sct.hsdp_hook(sharded(mesh["shard"], factor=mesh["shard"].size() + 1.0), "dense"),
            failures),
        **{f"{algorithm} refused": functools.partial(refuses, mesh, failures, algorithm, why)
           for algorithm, why in NOT_APPLICABLE.items()},
    }
    for name, case in cases.items():
        try:
            case()
        except Exception:  # noqa: BLE001 (a case's failure, reported with the rest)
            failures.append(f"{name}: {traceback.format_exc()}")
    if dist.get_rank() == 0:
        print(f"rank 0: mesh {tuple(mesh.mesh.shape)}, shards {say_sizes}", flush=True)
    report(f"{len(failures)} failed", failures)


if __name__ == "__main__":
    main()
