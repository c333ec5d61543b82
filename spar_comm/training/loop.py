"""The training loop as a library: ``train(config)`` runs one data-parallel
job on every rank of a communicator and returns its summary.

The loop is written against the Python array API (the namespace comes from
the parameters), so it runs on NumPy, CuPy or torch tensors alike; NumPy and
MPI appear only behind ``distributed``, ``data``, ``trace`` and ``checkpoint``.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Optional

import array_api_compat
from mpi4py import MPI
from tqdm import tqdm

from .. import __version__, waiting
from ..collectives import AUTO
from ..consensus import raise_if_any
from ..costmodel import auto
from ..errors import ConfigError, WriteError
from ..files import BadFileError
from ..outer import OuterStep
from ..topology import Topology
from . import compile_time
from .aids import LocalAids, ScheduledAllreduce
from .density import make_schedule
from .checkpoint import load_checkpoint, read_saved, save_checkpoint
from .config import TrainConfig
from .control import SAVE, STOPS, WRITE_FAILED, StopControl
from .data import Dataset, Shards, dataset_problem, load_dataset
from .distributed import Group, array_backend
from .models import build_model
from .optim import SGD
from .schedule import LearningRate
from .state import TrainState
from .trace import COLUMN, StepRecorder, TraceWriter


@dataclass
class Summary:
    """What a run achieved; the same on every rank. The times per step and
    ``steps_per_s`` leave out the run's first step, which compiles the kernels
    on a cold cache: ``first_step_s`` and ``compile_s`` report it apart."""

    steps: int
    total_steps: int
    test_metric: float
    train_loss: float
    wall: float
    steps_per_s: float
    step_s: float
    comm_s: float
    select_s: float
    stopped: str
    setup: str
    density: float = 1.0  # the mean density sent a step (schedules change it)
    bytes_inter: float = 0.0  # the mean bytes a rank sent between nodes a step
    first_step_s: float = 0.0  # the first step's seconds (0: it was the only one, and is in the means)
    compile_s: float = 0.0  # seconds a rank spent compiling Numba kernels, the mean over ranks

    def line(self) -> str:
        """The one line rank 0 prints at the end of a run."""
        stop = f" | stopped by {self.stopped} at step {self.steps}" if self.stopped else ""
        return (
            f"held-out accuracy {self.test_metric:.4f} | train loss {self.train_loss:.4f} | "
            f"{self.steps}/{self.total_steps} steps, {self.steps_per_s:.1f} steps/s | "
            f"communication {1e3 * self.comm_s:.2f} ms/step = {self._share(self.comm_s):.0f}% of step time "
            f"(+ select {self._share(self.select_s):.0f}%){self._first()} | {self.setup}{stop}"
        )

    def _first(self) -> str:
        """What the figures before leave out, when they leave anything out."""
        if not self.first_step_s:
            return ""
        return f" | not counted: first step {self.first_step_s:.2f} s, compiling {self.compile_s:.2f} s"

    def _share(self, seconds: float) -> float:
        return 100.0 * seconds / self.step_s if self.step_s > 0 else 0.0


def evaluate(model: Any, params: Any, data: Dataset, group: Group, xp: Any, device: Any) -> float:
    """Held-out accuracy; each rank scores its share of the test set."""
    x = xp.asarray(data.x_test[group.rank :: group.size], device=device)
    y = xp.asarray(data.y_test[group.rank :: group.size], device=device)
    correct = xp.sum(xp.astype(xp.argmax(model.logits(params, x), axis=1) == y, xp.int64))
    right, seen = group.sum([float(correct), y.shape[0]])
    return right / seen


def train(config: TrainConfig, comm: Optional[MPI.Comm] = None, model: Any = None, data: Any = None) -> Summary:
    """Train ``config`` on every rank of ``comm``: the loop ``drivers/train.py`` runs.

    Args:
        config: the run's settings (``TrainConfig``; the command line's flags).
        comm: the ranks; default MPI's world.
        model: in place of the built-in ``config.model``: any object with
            ``layout``, ``init(seed)``, ``logits(params, x)`` and
            ``loss_and_grad(params, batch)`` (``models.py``).
        data: in place of ``config.dataset``: any object with the fields of
            ``data.Dataset``.

    Returns:
        The run's ``Summary`` (its ``str`` is the line ``make train`` prints).

    Raises:
        ConfigError: on every rank alike, for bad settings, before any file is written.

    Example:
        >>> summary = train(TrainConfig(algorithm="hitopk", density=0.01, steps=100))
        >>> print(summary)

    Collective: every rank calls it.
    """
    problems = config.problems()
    if problems:
        raise ConfigError("; ".join(problems))
    compiled_before = compile_time.seconds()
    topology = Topology(comm, config.ranks_per_node, config.device)  # a rank without its GPU: ConfigError on all
    group = Group(topology)
    rank0 = group.rank == 0
    missing = config.resume and not os.path.exists(config.checkpoint)
    raise_if_any(topology.world, f"no checkpoint to resume at {config.checkpoint}" if missing else None)

    # -- the pieces: data, model, optimizer, allreducer -------------------------------
    xp, device = array_backend(topology.memory)
    data = data if data is not None else load_dataset(config.dataset, config.dtype)
    raise_if_any(topology.world, dataset_problem(data))
    model_name = config.model if model is None else type(model).__name__
    model = model if model is not None else build_model(config, data, xp, device)
    params = model.init(config.seed)
    xp, device = array_api_compat.array_namespace(params), array_api_compat.device(params)
    shards = Shards(len(data.y_train), group.rank, group.size, config.batch_size, config.seed)
    if shards.steps_per_epoch < 1:
        raise ConfigError(
            f"--batch-size {config.batch_size} is larger than a rank's share of the training set "
            f"({shards.per_rank} samples at {group.size} ranks)"
        )
    total = config.steps or (config.epochs or default_epochs(data.name)) * shards.steps_per_epoch
    lr_at = LearningRate(config.lr, total, config.warmup, config.schedule)
    density = make_schedule(config.density_schedule, config.density, shards.steps_per_epoch,
                            warmup_start=config.density_warmup_start, warmup_epochs=config.density_warmup,
                            high=config.accordion_high, eta=config.accordion_eta)
    options = dict(values=config.values, indices=config.indices)
    if config.algorithm == "powersgd":  # rank r over the model's own matrices
        options.update(rank=config.rank, shapes=[model.layout.shapes[name] for name in model.layout.names])
    saved = read_saved(config.checkpoint, group, model.layout) if config.resume else None  # checked whole, once
    pricing = None
    if auto.chooses(config.algorithm, config.values):  # what the run it resumes priced, whatever the link times now
        resuming = saved is not None and saved.priced is not None
        pricing = auto.resumed(topology, saved.priced) if resuming else auto.price(topology)
    allreduce = ScheduledAllreduce(group, config.algorithm, model.layout.size, config.dtype, config.selector, density,
                                   options, pricing)
    # Under the outer loop each rank's SGD is its inner optimizer, and the
    # DGC aids, which act on every step's gradient, stay off.
    outer = OuterStep(config.outer(), params) if config.sync_every else None
    aids = LocalAids(config, allreduce.sparse and outer is None, group.size, params, xp)
    optimizer = SGD(params, xp, aids.optimizer_momentum, aids.optimizer_weight_decay)
    state = TrainState(group, config, model.layout, params, optimizer.velocity, allreduce, shards, density, pricing,
                       aids.velocity)
    if outer is not None:  # the outer optimizer's velocity is shared, the inner ones each rank's own
        state.velocity, state.local_velocity = outer.velocity, optimizer.velocity

    # -- a fresh start (rank 0's weights everywhere) or a resume ------------------------
    if saved is not None:
        load_checkpoint(saved, config.checkpoint, state)
    else:
        group.broadcast(params, xp)
    if outer is not None:
        outer.restart(params)
    start = state.step
    name = f"auto: {allreduce.algorithm}" if config.algorithm == AUTO else config.algorithm
    method = f"{name}/{config.selector} density {config.density:g}" if allreduce.sparse else name
    if config.algorithm == "powersgd":
        method += f" rank {config.rank}"
    if allreduce.sparse:  # say what the schedule sends beside --density
        method += density.describe()
    if outer is not None:
        method += f", {outer.settings.describe()}"
    values = f"auto: {allreduce.values or 'as summed'}" if config.values == AUTO else config.values
    method += "".join(f", {codec} {kind}" for kind, codec in (("values", values), ("indices", config.indices)) if codec)
    if pricing is not None:  # what auto chose, and the cluster it priced
        method += f" ({pricing.describe()})"
    setup = (
        f"{method}, {model_name} "
        f"({model.layout.size:,} parameters) on {data.name}, {topology.describe().split(';')[0]}"
    )
    writer, problem = None, None
    if rank0 and config.trace:
        try:
            writer = TraceWriter(config.trace, trace_attributes(config, topology, model_name, data.name, model, shards, total),
                                 topology.hosts, resume_step=start if config.resume else None)
        except BadFileError as exc:  # the trace a resumed run would append to
            problem = f"cannot resume the trace {exc}"
        except OSError as exc:
            problem = f"cannot write the trace {config.trace}: {exc}"
    raise_if_any(topology.world, problem)
    forget_trace = waiting.at_end(writer.close) if writer else None  # a fault or a signal ends the job with it closed
    recorder = StepRecorder(group.comm, config.trace_every, writer)
    by_clock = config.checkpoint and not config.checkpoint_every and config.checkpoint_period
    stop = StopControl(group, config.stop_after, config.time_limit, config.checkpoint_period if by_clock else None)
    bar = tqdm(total=total, initial=start, disable=not (rank0 and config.progress), unit="step", dynamic_ncols=True)

    # -- the loop ------------------------------------------------------------------------
    began = time.perf_counter()
    steady_began = began  # from the end of the first step on, which compiles
    loss_sum, loss_count, reason = 0.0, 0, 0
    accuracy, train_loss, evaluated_at = float("nan"), float("nan"), -1
    step = start
    while step < total and not reason:
        t0 = time.perf_counter()
        idx = shards.indices(step)
        batch = (xp.asarray(data.x_train[idx], device=device), xp.asarray(data.y_train[idx], device=device))
        t1 = time.perf_counter()
        loss, grad = model.loss_and_grad(params, batch)
        lr = lr_at(step)
        if outer is None:
            grad = aids.before_allreduce(grad, params)
            t2 = time.perf_counter()
            grad = allreduce.reduce(step, grad, xp)
            t3 = time.perf_counter()
            aids.after_allreduce(grad)
            optimizer.step(params, grad, lr)
        else:  # an inner step, this rank's alone
            t2 = t3 = time.perf_counter()
            optimizer.step(params, grad, lr)
        t4 = time.perf_counter()
        step += 1
        state.step = step
        flags = stop.check(step, writer is not None and writer.failure is not None)
        if flags & WRITE_FAILED:
            raise_if_any(group.comm, writer and writer.failure, WriteError)
        reason = flags & STOPS
        last, update = NOTHING_SENT, t4 - t3
        if outer is not None and (outer.due(step) or step == total or flags & (STOPS | SAVE)):
            # The outer step, also where the run stops or saves by the clock, so
            # that every checkpoint holds weights that all ranks share.
            reduced = allreduce.reduce(step - 1, outer.pseudo_gradient(params), xp)
            t5 = time.perf_counter()
            outer.apply(reduced, params)
            last, update = allreduce.last, update + time.perf_counter() - t5
        elif outer is None:
            last = allreduce.last
        if step == start + 1:
            steady_began = time.perf_counter()
        recorder.record(step - 1, dict(
            data=t1 - t0, compute=t2 - t1, select=last["t_select"], comm_intra=last["t_intra"],
            comm_inter=last["t_inter"], update=update, step=time.perf_counter() - t0,
            bytes_intra=last["bytes_intra"], bytes_inter=last["bytes_inter"], k=last["k"],
            threshold=last["threshold"], loss=loss, lr=lr, density=allreduce.density,
        ))
        loss_sum, loss_count = loss_sum + loss, loss_count + 1
        bar.update(1)
        if step % shards.steps_per_epoch == 0 or step == total or reason:
            accuracy = evaluate(model, params if outer is None else outer.start, data, group, xp, device)
            mean_loss = group.sum([loss_sum, loss_count])
            train_loss = mean_loss[0] / max(mean_loss[1], 1)
            loss_sum, loss_count, evaluated_at = 0.0, 0, step
            if writer:
                writer.add_eval(step=step, epoch=step / shards.steps_per_epoch, train_loss=train_loss,
                                test_metric=accuracy, wall=time.perf_counter() - began)
            bar.set_postfix(loss=f"{train_loss:.4f}", acc=f"{accuracy:.4f}")
        due = flags & SAVE or (config.checkpoint_every and step % config.checkpoint_every == 0)
        if due and step < total and not reason:
            recorder.flush()  # the trace then holds every step the checkpoint covers
            save_checkpoint(state, config.checkpoint)
            stop.saved()
    wall = time.perf_counter() - began
    recorder.flush()
    bar.close()
    stop.restore()

    # -- the end: a last evaluation if the loop did none, a checkpoint, the summary ------
    if evaluated_at != step:  # the weights all ranks share (the outer loop's last step ended the loop)
        accuracy = evaluate(model, params, data, group, xp, device)
    if config.checkpoint:
        save_checkpoint(state, config.checkpoint)
    if writer:
        forget_trace()
        writer.close()
    raise_if_any(group.comm, writer and writer.failure, WriteError)
    compiled = group.sum([compile_time.seconds() - compiled_before])[0] / group.size
    summary = None
    if rank0:
        per_step, steady = recorder.means(), recorder.means(after_first=True)
        apart = step - start > 1  # a lone step is the means' only one
        counted, counted_s = (step - start - 1, began + wall - steady_began) if apart else (step - start, wall)
        summary = Summary(
            steps=step, total_steps=total, test_metric=accuracy, train_loss=train_loss, wall=wall,
            steps_per_s=counted / counted_s if counted_s > 0 else 0.0, step_s=steady[COLUMN["step"]],
            comm_s=steady[COLUMN["comm_intra"]] + steady[COLUMN["comm_inter"]],
            select_s=steady[COLUMN["select"]], stopped=StopControl.describe(reason), setup=setup,
            density=per_step[COLUMN["density"]], bytes_inter=per_step[COLUMN["bytes_inter"]],
            first_step_s=recorder.first[:, COLUMN["step"]].mean() if apart else 0.0, compile_s=compiled,
        )
    with waiting.watched("Bcast of the summary", group.comm):
        return group.comm.bcast(summary, root=0)


#: A step that sends nothing: an inner step of the outer loop.
NOTHING_SENT = dict(t_select=0.0, t_intra=0.0, t_inter=0.0, bytes_intra=0, bytes_inter=0, k=0, threshold=0.0)


def default_epochs(dataset: str) -> int:
    """Epochs when neither --epochs nor --steps is given: enough for digits."""
    return 30 if dataset == "digits" else 1


def trace_attributes(config: TrainConfig, topology: Topology, model_name: str, dataset: str, model: Any,
                     shards: Shards, total: int) -> dict:
    """The root attributes of the trace (docs/design.md, Trace)."""
    return dict(
        model=model_name, dataset=dataset,
        version=__version__, world_size=topology.world.size, nodes=topology.num_nodes,
        ranks_per_node=topology.node_sizes, algorithm=config.algorithm, selector=config.selector,
        density=config.density, config=config.to_json(), test_metric_name="accuracy",
        parameters=model.layout.size, steps_per_epoch=shards.steps_per_epoch, total_steps=total,
        topology=topology.describe().split(";")[0],
    )
