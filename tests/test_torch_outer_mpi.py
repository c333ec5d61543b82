"""spar_comm.torch.OuterLoop under MPI: the same bits on every rank after each
outer step, error feedback conserving the pseudo-gradients, H = 1 against
the per-step DistributedOptimizer, dense DiLoCo against a serial NumPy
reference, a save and load that resumes to the same bits, and what is
refused (alike on every rank); under overlap, the late outer step against a
serial reference, conservation, a resume, and a NaN found in flight. A linear layer of 104 parameters in two
buckets (its weight and its bias), at the default world."""
from __future__ import annotations

import io

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import spar_comm.torch as sct  # noqa: E402
from mpi_helpers import assert_all, assert_identical_bits  # noqa: E402
from spar_comm import ConfigError, NonFiniteGradientError, Topology  # noqa: E402

COMM = MPI.COMM_WORLD
torch.set_num_threads(1)  # the ranks fill the cores already
IN, OUT, BATCH = 12, 8, 4
TINY_CAP = 1e-6  # MB: a bucket a parameter


@pytest.fixture(scope="module")
def topo():
    """The launch's emulated nodes (SPAR_COMM_RANKS_PER_NODE): 2+1 at 3 ranks."""
    topology = Topology()
    yield topology
    topology.free()


def batch(seed: int, rank: int, step: int):
    """Rank ``rank``'s batch of inner step ``step``: every rank can make every rank's."""
    rng = np.random.default_rng([seed, rank, step])
    return rng.standard_normal((BATCH, IN)), rng.standard_normal((BATCH, OUT))


def model_of(seed: int, dtype=torch.float64) -> torch.nn.Linear:
    torch.manual_seed(seed + 100 * COMM.rank)  # different on every rank: the loop broadcasts rank 0's
    return torch.nn.Linear(IN, OUT).to(dtype)


def inner_step(model, inner, seed: int, step: int) -> None:
    x, y = (torch.from_numpy(a).to(model.weight.dtype) for a in batch(seed, COMM.rank, step))
    (0.5 * ((model(x) - y) ** 2).sum(1).mean()).backward()
    inner.step()
    inner.zero_grad()


def weights(model) -> np.ndarray:
    """The parameters flat, in the buckets' order (the bias first: buckets fill in reverse registration order)."""
    return torch.cat([model.bias.detach().flatten(), model.weight.detach().flatten()]).numpy().copy()


def residuals(outer) -> np.ndarray:
    return np.concatenate([b.reducer.residual_full() if b.reducer.keeps_residual else np.zeros(b.reducer.size)
                           for b in outer.buckets])


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm, values", [("hitopk", None), ("topka", None), ("gtopk", None), ("dense", "int8")])
def test_every_rank_holds_the_same_bits_and_error_feedback_conserves(topo, algorithm, values):
    """With lr 1 and no momentum the start moves by the mean of what was sent:
    the ranks' pseudo-gradients summed over ranks and outer steps equal
    ranks x (first start - last start) plus the residuals summed over ranks
    (allclose in float64: ``w - (w - u)`` rounds)."""
    model = model_of(1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = sct.OuterLoop(model.named_parameters(), every=2, algorithm=algorithm, density=0.2, values=values,
                          selector="exact", lr=1.0, momentum=0.0, bucket_cap_mb=TINY_CAP, topology=topo)
    assert_all(COMM, len(outer.buckets) == 2, f"{len(outer.buckets)} buckets")
    first = start = weights(model)
    assert_identical_bits(COMM, first, "the weights after construction")
    sent = np.zeros_like(first)
    for step in range(6):
        inner_step(model, inner, 1, step)
        before = weights(model)
        if outer.step():
            sent += start - before  # this rank's pseudo-gradient, computed here
            start = weights(model)
            assert_identical_bits(COMM, start, f"the weights after the outer step at {step}")
            assert_all(COMM, np.array_equal(start, np.concatenate([b.outer.start.numpy() for b in outer.buckets])),
                       "the parameters are not the outer start")
        else:
            assert_all(COMM, outer.inner_steps == 1, f"inner_steps {outer.inner_steps}")
    assert_all(COMM, outer.outer_steps == 3, f"{outer.outer_steps} outer steps")
    total_sent = COMM.allreduce(sent)
    kept = COMM.allreduce(residuals(outer))
    assert_all(COMM, bool(np.abs(kept).max() > 0), "no residual: the test checks nothing")
    assert_all(COMM, np.allclose(COMM.size * (first - start) + kept, total_sent, rtol=1e-12, atol=1e-12),
               f"not conserved: {np.abs(COMM.size * (first - start) + kept - total_sent).max()}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm, values", [("dense", None), ("hitopk", None), ("topka", "int8")])
def test_every_1_with_outer_sgd_is_the_per_step_algorithm(topo, algorithm, values):
    """H = 1, outer SGD of lr 1 without momentum, and a plain SGD inside,
    computes what DistributedOptimizer with the same algorithm computes:
    allclose, not bit for bit, since the outer loop reduces ``w - (w - lr*g)``
    where the optimizer reduces ``g`` and then steps by ``lr`` times the mean
    (the two round differently; the selections agree up to that rounding).
    The int8 codec's scale is a float32 figure: there the two agree to float32's rounding."""
    options = dict(algorithm=algorithm, density=0.2, values=values, selector="exact", bucket_cap_mb=TINY_CAP)
    outer_model = model_of(2)
    outer = sct.OuterLoop(outer_model.named_parameters(), every=1, lr=1.0, momentum=0.0, topology=topo, **options)
    inner = torch.optim.SGD(outer_model.parameters(), lr=0.05)
    step_model = model_of(2)
    step_model.load_state_dict(outer_model.state_dict())  # rank 0's, as the outer loop broadcast them
    per_step = sct.DistributedOptimizer(torch.optim.SGD(step_model.parameters(), lr=0.05),
                                        step_model.named_parameters(), topology=topo, **options)
    for step in range(4):
        inner_step(outer_model, inner, 2, step)
        assert_all(COMM, outer.step(), "no outer step with every=1")
        inner_step(step_model, per_step, 2, step)
        got, want = weights(outer_model), weights(step_model)
        assert_identical_bits(COMM, got, "the outer loop's weights")
        tolerance = 1e-6 if values else 1e-9
        assert_all(COMM, np.allclose(got, want, rtol=tolerance, atol=tolerance * (0.1 if values else 1e-3)),
                   f"step {step}: differs from the per-step algorithm by {np.abs(got - want).max()}")


def serial_diloco(start: np.ndarray, ranks: int, every: int, outer_steps: int, inner_lr: float,
                  lr: float, momentum: float) -> list:
    """DiLoCo by hand in float64: each rank's inner SGD from the shared start,
    the mean pseudo-gradient, and Nesterov's outer step. The start after each
    outer step (flat as ``weights``: the bias, then the weight)."""
    velocity, starts = np.zeros_like(start), []
    for outer in range(outer_steps):
        delta = np.mean([start - local_sgd(start, 3, r, range(outer * every, (outer + 1) * every), inner_lr)
                         for r in range(ranks)], axis=0)
        start, velocity = nesterov(start, velocity, delta, lr, momentum)
        starts.append(start)
    return starts


def local_sgd(flat: np.ndarray, seed: int, rank: int, steps: range, lr: float) -> np.ndarray:
    """``inner_step``'s plain SGD by hand, rank ``rank``'s batches of ``steps``, from ``flat``."""
    b, w = flat[:OUT].copy(), flat[OUT:].reshape(OUT, IN).copy()
    for t in steps:
        x, y = batch(seed, rank, t)
        residual = x @ w.T + b - y
        w -= lr * residual.T @ x / BATCH
        b -= lr * residual.mean(axis=0)
    return np.concatenate([b, w.ravel()])


def nesterov(start: np.ndarray, velocity: np.ndarray, delta: np.ndarray, lr: float, momentum: float):
    velocity = momentum * velocity + delta
    return start - lr * (delta + momentum * velocity), velocity


def serial_overlap(start: np.ndarray, ranks: int, every: int, tau: int, steps: int, inner_lr: float, lr: float,
                   momentum: float) -> list:
    """The overlapped loop by hand: at an outer step each rank's progress
    since its anchor goes to the reduction and its anchor becomes its
    weights; ``tau`` inner steps later the mean steps the start, and each
    rank takes the start plus its progress since its anchor. After each
    outer step, (the start, every rank's weights); then ``synchronize()``'s:
    the pending mean, and one more outer step."""
    velocity, pending, out = np.zeros_like(start), None, []
    weights, anchors = [start.copy() for _ in range(ranks)], [start.copy() for _ in range(ranks)]

    def merge(start, velocity, weights):
        start, velocity = nesterov(start, velocity, pending, lr, momentum)
        return start, velocity, [w - a + start for w, a in zip(weights, anchors)], [start] * ranks

    for t in range(steps):
        weights = [local_sgd(w, 9, r, range(t, t + 1), inner_lr) for r, w in enumerate(weights)]
        if (t + 1) % every == tau % every and pending is not None:
            start, velocity, weights, anchors = merge(start, velocity, weights)
            pending = None
        if (t + 1) % every == 0:
            pending = np.mean([a - w for a, w in zip(anchors, weights)], axis=0)
            anchors = [w.copy() for w in weights]
            out.append((start, weights))
    if pending is not None:
        start, velocity, weights, anchors = merge(start, velocity, weights)
    start, velocity = nesterov(start, velocity, np.mean([a - w for a, w in zip(anchors, weights)], axis=0),
                               lr, momentum)
    return out + [(start, [start] * ranks)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("lr, momentum, tau", [(1.0, 0.0, 3), (0.7, 0.9, 1)])
def test_overlap_takes_each_mean_tau_steps_late_as_a_serial_reference_does(topo, lr, momentum, tau):
    """The start the same bits on every rank after each outer step, each
    rank's weights its own (the start plus its progress since the outer
    step), and after ``synchronize()`` every rank at the same bits: all as
    the serial reference computes them. The reductions, on their thread,
    use communicators of their own."""
    model = model_of(9)
    outer = sct.OuterLoop(model.named_parameters(), every=3, algorithm="dense", lr=lr, momentum=momentum,
                          overlap=tau, bucket_cap_mb=TINY_CAP, topology=topo)
    ours = [outer.topology.world, *(b.reducer.topology.world for b in outer.buckets)]
    assert_all(COMM, all(comm not in (topo.world, COMM) for comm in ours),
               "the thread's reductions share the caller's communicators")  # its collectives would meet theirs
    expected = serial_overlap(weights(model), COMM.size, 3, tau, 10, 0.05, lr, momentum)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(10):
        inner_step(model, inner, 9, step)
        if outer.step():
            start, mine = expected[outer.outer_steps - 1][0], expected[outer.outer_steps - 1][1][COMM.rank]
            got = np.concatenate([b.outer.start.numpy() for b in outer.buckets])
            assert_identical_bits(COMM, got, "the start")
            assert_all(COMM, np.allclose(got, start, rtol=1e-10, atol=1e-12) and
                       np.allclose(weights(model), mine, rtol=1e-10, atol=1e-12),
                       f"outer step {outer.outer_steps}: the start off by {np.abs(got - start).max()}, "
                       f"the weights by {np.abs(weights(model) - mine).max()}")
    distinct = len(set(COMM.allgather(weights(model).tobytes())))
    assert_all(COMM, distinct == COMM.size, "the ranks' weights alike between outer steps: the test shows nothing")
    outer.synchronize()
    assert_identical_bits(COMM, weights(model), "the weights after synchronize()")
    assert_all(COMM, np.allclose(weights(model), expected[-1][0], rtol=1e-10, atol=1e-12),
               f"synchronize() off by {np.abs(weights(model) - expected[-1][0]).max()}")


@pytest.mark.mpi(min_size=2)
def test_overlap_with_error_feedback_conserves_every_rank_s_progress(topo):
    """hitopk, lr 1, no momentum, the mean taken an inner step late: after
    ``synchronize()`` what the inner steps took off the weights, summed over
    ranks, equals ranks x (first start - last start) plus the residuals
    summed over ranks (taking a mean leaves a rank's weights less its anchor
    as they were)."""
    model = model_of(10)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = sct.OuterLoop(model.named_parameters(), every=2, algorithm="hitopk", density=0.2, selector="exact",
                          overlap=1, bucket_cap_mb=TINY_CAP, topology=topo)
    first = weights(model)
    sent = np.zeros_like(first)
    for step in range(7):
        before = weights(model)
        inner_step(model, inner, 10, step)
        sent += before - weights(model)  # this rank's pseudo-gradient, inner step by inner step
        outer.step()
    outer.synchronize()
    last = weights(model)
    assert_identical_bits(COMM, last, "the weights after synchronize()")
    total_sent, kept = COMM.allreduce(sent), COMM.allreduce(residuals(outer))
    assert_all(COMM, bool(np.abs(kept).max() > 0), "no residual: the test checks nothing")
    assert_all(COMM, np.allclose(COMM.size * (first - last) + kept, total_sent, rtol=1e-12, atol=1e-12),
               f"not conserved: {np.abs(COMM.size * (first - last) + kept - total_sent).max()}")


@pytest.mark.mpi(min_size=2)
def test_dense_nesterov_is_diloco_as_a_serial_reference_computes_it(topo):
    model = model_of(3)
    outer = sct.OuterLoop(model.named_parameters(), every=3, algorithm="dense", lr=0.7, momentum=0.9,
                          bucket_cap_mb=TINY_CAP, topology=topo)
    expected = serial_diloco(weights(model), COMM.size, 3, 3, 0.05, 0.7, 0.9)
    inner = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(9):
        inner_step(model, inner, 3, step)
        if outer.step():
            got = weights(model)
            assert_identical_bits(COMM, got, "the weights")
            want = expected[outer.outer_steps - 1]
            assert_all(COMM, np.allclose(got, want, rtol=1e-10, atol=1e-12),
                       f"outer step {outer.outer_steps}: off by {np.abs(got - want).max()}")


def resumable_run(topo, seed: int, overlap: int = 0):
    """hitopk with a dense= bias (one bucket sparse, one dense), an outer
    momentum (a velocity to carry over) and an inner SGD with momentum."""
    model = model_of(seed, torch.float32)
    outer = sct.OuterLoop(model.named_parameters(), every=3, algorithm="hitopk", density=0.2, dense=["bias"],
                          lr=0.8, momentum=0.5, bucket_cap_mb=TINY_CAP, overlap=overlap, topology=topo)
    inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return model, inner, outer


def saved(*states):
    """Through torch.save and torch.load, as a file of this rank's would hold them."""
    buffer = io.BytesIO()
    torch.save(states, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [0, 2])
def test_a_save_and_load_between_outer_steps_resumes_to_the_same_bits(topo, overlap):
    """Under overlap the state is taken with a reduction in flight, whose
    mean the weights take a step later, and the run that saved it goes on
    past it to the same bits."""
    model, inner, outer = resumable_run(topo, 4, overlap)
    for step in range(10):
        inner_step(model, inner, 4, step)
        outer.step()
        if step == 6:  # one inner step past an outer step
            outer_state, inner_state = saved(outer.state_dict(), inner.state_dict())
    straight = weights(model)
    outer.synchronize()
    straight_synchronized = weights(model)
    assert_all(COMM, outer_state["inner_steps"] == 1 and list(outer_state["local"]) == [f"rank{COMM.rank}"],
               "not saved between two outer steps")
    assert_all(COMM, outer_state.get("unmerged", False) == bool(overlap), "no mean pending in the state")
    model, inner, outer = resumable_run(topo, 5, overlap)  # other weights, no state
    outer.load_state_dict(outer_state)
    inner.load_state_dict(inner_state)
    for step in range(7, 10):
        inner_step(model, inner, 4, step)
        outer.step()
    resumed = weights(model)
    assert_all(COMM, np.array_equal(straight, resumed),
               f"the resumed run differs by {np.abs(straight - resumed).max()} from the one that never stopped")
    assert_all(COMM, outer.outer_steps == 3, f"{outer.outer_steps} outer steps")
    outer.synchronize()  # the reduction the loaded residuals feed, and under overlap the one in flight
    assert_all(COMM, np.array_equal(straight_synchronized, weights(model)), "differs after synchronize()")


@pytest.mark.mpi(min_size=2)
def test_a_state_that_does_not_fit_is_refused_on_every_rank_naming_why(topo):
    model, inner, outer = resumable_run(topo, 6)
    inner_step(model, inner, 6, 0)
    outer.step()
    state = outer.state_dict()
    before = weights(model)
    cases = [
        ({**state, "format": 99}, "format 99, which this version does not read"),
        ({**state, "world_size": COMM.size + 1}, "resumes on the number of ranks that saved it"),
        ({**state, "start": {}}, "start of bucket 0 is not a tensor"),
        (COMM.bcast(state), "not this rank's"),  # rank 0's state loaded by every rank
    ]
    for bad, match in cases:
        with pytest.raises(ConfigError, match=match):
            outer.load_state_dict(bad)
    assert_all(COMM, np.array_equal(weights(model), before), "a refused state changed the weights")
    lost = {**state, "start": {key: value + COMM.rank for key, value in state["start"].items()}}
    with pytest.raises(ConfigError, match="the ranks loaded different outer states"):
        outer.load_state_dict(lost)


def error_of(make) -> str:
    try:
        make()
    except ConfigError as error:
        return str(error)
    return "no error"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting, match", [
    ({"every": 0}, "period must be >= 1 inner step, got 0"),
    ({"every": 2.5}, "period .* must be an integer"),
    ({"lr": -1.0}, "outer learning rate must be > 0, got -1"),
    ({"momentum": 1.0}, r"outer momentum must be in \[0, 1\), got 1"),
    ({"lr": "fast"}, "outer lr must be a number"),
    ({"every": 2 + COMM.rank}, "ranks disagree on the OuterLoop settings: every"),
    ({"algorithm": "nope"}, "nope"),
    ({"overlap": 4}, r"overlap must be 0 or the inner steps in \[1, every=3\] .* got 4"),
    ({"overlap": True}, "overlap must be 0 or the inner steps .* got True"),
])
def test_a_bad_setting_raises_the_same_config_error_on_every_rank(topo, setting, match):
    model = model_of(7)
    message = error_of(lambda: sct.OuterLoop(model.named_parameters(), **{"every": 3, "topology": topo, **setting}))
    assert_all(COMM, len(set(COMM.allgather(message))) == 1, f"the ranks' errors differ: {message}")
    assert_all(COMM, __import__("re").search(match, message) is not None, message)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("non_finite", ["propagate", "raise"])
def test_a_nan_on_one_rank_is_alike_on_every_rank(topo, non_finite):
    """``propagate``: the NaN bucket's mean is NaN on every rank and taken as
    it is, the other bucket steps; ``raise``: NonFiniteGradientError on every
    rank, every rank back at the period's start, the residuals as they were."""
    model = model_of(8)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = sct.OuterLoop(model.named_parameters(), every=2, algorithm="hitopk", density=0.2,
                          bucket_cap_mb=TINY_CAP, non_finite=non_finite, topology=topo)
    for step in range(2):
        inner_step(model, inner, 8, step)
        outer.step()
    start, kept = weights(model), residuals(outer)
    inner_step(model, inner, 8, 2)
    assert_all(COMM, not outer.step(), "an outer step after one inner step")
    inner_step(model, inner, 8, 3)
    if COMM.rank == COMM.size - 1:  # after the inner steps: a NaN in the weight's bucket alone
        with torch.no_grad():
            model.weight[1, 2] = float("nan")
    if non_finite == "raise":
        with pytest.raises(NonFiniteGradientError):
            outer.step()
        assert_identical_bits(COMM, weights(model), "the weights after a refused outer step")
        assert_all(COMM, np.array_equal(weights(model), start), "not back at the period's start")
        assert_all(COMM, np.array_equal(residuals(outer), kept), "the residuals changed")
        assert_all(COMM, outer.inner_steps == 0, f"inner_steps {outer.inner_steps}")
    else:
        outer.step()
        got = weights(model)
        nan = np.isnan(got)
        assert_all(COMM, bool(nan[OUT:].all()) and not nan[:OUT].any(), "NaN not where the NaN bucket is")
        assert_identical_bits(COMM, got[:OUT], "the finite bucket")


@pytest.mark.mpi(min_size=2)
def test_overlap_raises_a_nan_at_the_next_outer_step_with_every_rank_at_the_start(topo):
    """Under ``"raise"`` the reduction in flight finds the NaN; the outer step
    that waits for it raises on every rank, which all go back to the start."""
    model = model_of(11)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = sct.OuterLoop(model.named_parameters(), every=2, algorithm="hitopk", density=0.2, overlap=2,
                          bucket_cap_mb=TINY_CAP, non_finite="raise", topology=topo)
    for step in range(4):
        inner_step(model, inner, 11, step)
        if step == 3 and COMM.rank == COMM.size - 1:  # handed to the reduction at this outer step
            with torch.no_grad():
                model.weight[1, 2] = float("nan")
        outer.step()
    start = np.concatenate([b.outer.start.numpy() for b in outer.buckets])
    inner_step(model, inner, 11, 4)
    with pytest.raises(NonFiniteGradientError):
        outer.synchronize()
    assert_identical_bits(COMM, weights(model), "the weights after the refused outer step")
    assert_all(COMM, np.array_equal(weights(model), start) and not np.isnan(start).any(), "not back at the start")
    assert_all(COMM, outer.inner_steps == 0, f"inner_steps {outer.inner_steps}")
