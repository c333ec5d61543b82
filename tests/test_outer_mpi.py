"""The outer loop (spar_comm/outer.py) around real allreducers and in
train(): identical bits on every rank after each outer step; conservation
under error feedback; DiLoCo's Nesterov step against a serial NumPy
reference; an outer step of period 1 against the per-step algorithm; a
resume to the same bits; bytes in the trace only where the ranks synchronise."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from mpi4py import MPI

from mpi_helpers import LAYOUT_WORLDS, assert_all, assert_identical_bits
from spar_comm.outer import OuterSettings, OuterStep
from spar_comm.training import TrainConfig, read_trace, train
from spar_comm.training.aids import ScheduledAllreduce
from spar_comm.training.data import load_dataset
from spar_comm.training.density import Fixed
from spar_comm.training.distributed import Group
from spar_comm.training.models import build_model

COMM = MPI.COMM_WORLD
SPARSE = ["topka", "gtopk", "hitopk"]


def drift(rng: np.random.Generator, n: int) -> np.ndarray:
    """What a rank's inner steps moved its weights by (random: the outer step does not care how)."""
    return rng.standard_normal(n) * rng.uniform(0.1, 3.0)


@pytest.mark.worlds(*LAYOUT_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", SPARSE)
def test_error_feedback_alone_conserves_the_pseudo_gradients(topology, algorithm):
    """SparseLoCo's outer step (lr 1, no momentum): summed over ranks and
    outer steps, the start's change times the ranks plus the residuals equals
    the pseudo-gradients sent; every rank holds the same bits after each step."""
    n, outer_steps = 1031, 4
    reducer = ScheduledAllreduce(Group(topology), algorithm, n, "float64", "exact", Fixed(0.05))
    params = np.random.default_rng(5).standard_normal(n)
    outer = OuterStep(OuterSettings(every=3, lr=1.0, momentum=0.0), params)
    first = params.copy()
    rng = np.random.default_rng([7, COMM.rank])
    sent = np.zeros(n)
    for step in range(outer_steps):
        params -= drift(rng, n)  # this rank's inner steps
        delta = outer.pseudo_gradient(params)
        sent += delta
        outer.apply(reducer.reduce(step, delta, np), params)
        assert_identical_bits(COMM, params, f"weights after outer step {step}")
        assert_all(COMM, np.array_equal(params, outer.start), "the weights are not the new start")
    applied = (first - params) * COMM.size  # the allreducer averages
    total_sent = COMM.allreduce(sent)
    kept = COMM.allreduce(reducer.current.reducer.residual_full())
    error = np.abs(applied + kept - total_sent).max()
    assert_all(COMM, error <= 1e-10 * np.abs(total_sent).max(), f"conservation error {error:.3g}")
    assert_all(COMM, np.abs(kept).max() > 0, "nothing was kept: the test selected everything")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("nesterov", [True, False])
def test_the_dense_outer_step_is_dilocos(topology, nesterov):
    """DiLoCo's outer optimizer over a dense allreducer against a serial NumPy
    reference that draws every rank's drift itself."""
    n, outer_steps, lr, momentum = 257, 3, 0.7, 0.9
    reducer = ScheduledAllreduce(Group(topology), "dense", n, "float64", "exact", Fixed(1.0))
    params = np.random.default_rng(5).standard_normal(n)
    outer = OuterStep(OuterSettings(every=4, lr=lr, momentum=momentum, nesterov=nesterov), params)
    mine = np.random.default_rng([7, COMM.rank])
    everyone = [np.random.default_rng([7, r]) for r in range(COMM.size)]
    start, velocity = params.copy(), np.zeros(n)
    for step in range(outer_steps):
        params -= drift(mine, n)
        outer.apply(reducer.reduce(step, outer.pseudo_gradient(params), np), params)
        mean = np.mean([drift(rng, n) for rng in everyone], axis=0)  # each rank's pseudo-gradient is its drift
        velocity = momentum * velocity + mean
        start = start - lr * (mean + momentum * velocity if nesterov else velocity)
        assert_all(COMM, np.allclose(params, start, rtol=1e-12, atol=1e-12),
                   f"outer step {step}: {np.abs(params - start).max():.3g} from the reference")
        assert_identical_bits(COMM, params, f"weights after outer step {step}")


class Kept:
    """The built-in model, keeping a reference to the weights train() updates in place."""

    def __init__(self, config: TrainConfig):
        self.data = load_dataset(config.dataset, config.dtype)
        self.model = build_model(config, self.data, np, None)
        self.layout = self.model.layout
        self.params = None

    def init(self, seed: int):
        self.params = self.model.init(seed)
        return self.params

    def logits(self, params, x):
        return self.model.logits(params, x)

    def loss_and_grad(self, params, batch):
        return self.model.loss_and_grad(params, batch)


def trained(**changes) -> SimpleNamespace:
    """A short train() on the digits (float64), its summary and its final weights."""
    config = TrainConfig(**{**dict(trace=None, progress=False, dtype="float64", hidden=64), **changes})
    kept = Kept(config)
    summary = train(config, COMM, model=kept, data=kept.data)
    return SimpleNamespace(summary=summary, params=kept.params)


@pytest.mark.worlds(2, 4)
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["dense", "hitopk"])
def test_an_outer_step_every_step_is_the_per_step_algorithm(algorithm):
    """H = 1, an outer SGD of lr 1 without momentum, an inner SGD without
    momentum or weight decay at a constant learning rate: the per-step
    algorithm's update, allclose and not bit for bit, since the outer step
    applies ``w - (w - lr*u)`` where the per-step one applies ``lr*u``."""
    plain = dict(algorithm=algorithm, steps=12, momentum=0.0, weight_decay=0.0, warmup=0, schedule="constant",
                 momentum_correction=False, ranks_per_node=2)
    per_step = trained(**plain)
    outer = trained(sync_every=1, **plain)  # the outer step's defaults: lr 1, no momentum
    gap = np.abs(outer.params - per_step.params).max()
    assert_all(COMM, np.allclose(outer.params, per_step.params, rtol=1e-9, atol=1e-11), f"{gap:.3g} apart")
    assert_all(COMM, gap > 0 or algorithm == "dense", "bit for bit: the test no longer sees the rounding")
    assert_identical_bits(COMM, outer.params, "weights")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["dense", "hitopk"])
def test_the_outer_loop_trains_and_resumes_to_the_same_bits(tmp_path_factory, algorithm):
    """A run stopped at an outer step and resumed ends on the bits of the run
    that never stopped; its trace shows bytes only on the steps that
    synchronise; the default outer loop (H = 4) learns the digits."""
    folder = COMM.bcast(str(tmp_path_factory.mktemp("outer")) if COMM.rank == 0 else None)
    run = dict(algorithm=algorithm, density=0.05, epochs=3, sync_every=4)
    whole = trained(trace=f"{folder}/whole.h5", **run)
    assert_identical_bits(COMM, whole.params, "weights")
    assert_all(COMM, whole.summary.test_metric > 0.85, f"held-out accuracy {whole.summary.test_metric:.3f}")
    checkpoint = f"{folder}/run.h5"
    first = trained(checkpoint=checkpoint, stop_after=16, **run)
    assert_all(COMM, first.summary.steps == 16 and first.summary.stopped, str(first.summary))
    resumed = trained(checkpoint=checkpoint, resume=True, **run)
    assert_all(COMM, np.array_equal(resumed.params, whole.params),
               f"{np.abs(resumed.params - whole.params).max():.3g} from the run that never stopped")
    if COMM.rank == 0:
        trace = read_trace(f"{folder}/whole.h5")
        steps, sent = trace.data["step"], trace.data["bytes/inter"].sum(axis=1)
        total = whole.summary.total_steps
        synced = (steps + 1) % 4 == 0
        synced[steps == total - 1] = True
        assert (sent[synced] > 0).all() and (sent[~synced] == 0).all(), (steps, sent)


@pytest.mark.mpi(min_size=2)
def test_a_stop_between_outer_steps_takes_the_outer_step_first(tmp_path_factory):
    """A run stopped after 10 steps with H = 4 synchronises at the stop, so its
    checkpoint holds weights every rank shares, and the resumed run goes on
    from them to the end, all ranks alike."""
    folder = COMM.bcast(str(tmp_path_factory.mktemp("outer")) if COMM.rank == 0 else None)
    run = dict(algorithm="hitopk", density=0.05, steps=20, sync_every=4, checkpoint=f"{folder}/run.h5",
               trace=f"{folder}/run.trace.h5")
    first = trained(stop_after=10, **run)
    assert_all(COMM, first.summary.steps == 10, str(first.summary))
    assert_identical_bits(COMM, first.params, "weights at the stop")
    resumed = trained(resume=True, **run)
    assert_all(COMM, resumed.summary.steps == 20, str(resumed.summary))
    assert_identical_bits(COMM, resumed.params, "weights at the end")
    if COMM.rank == 0:
        trace = read_trace(f"{folder}/run.trace.h5")
        synced = trace.data["step"][trace.data["bytes/inter"].sum(axis=1) > 0] + 1
        assert list(synced) == [4, 8, 10, 12, 16, 20], synced  # at the stop too, then where H divides the step
