"""spar_comm.torch under MPI: each bucket against the serial reference, the
dense mean to the bit, overlap with backward, accumulation, dense=
exclusions, the state_dict round trip and resume, and bad input on one rank."""
from __future__ import annotations

import time
import warnings

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")

import spar_comm.torch as sct  # noqa: E402
from spar_comm.torch.streams import tensor_device  # noqa: E402
from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits# noqa: E402
from reference import Reference, reproducible  # noqa: E402
from spar_comm import ConfigError, NonFiniteGradientError, Topology  # noqa: E402
from spar_comm.costmodel import gbps_to_beta, probe  # noqa: E402
from spar_comm.costmodel.auto import ENV_CALIBRATION  # noqa: E402
from spar_comm.collectives.checks import CODECS  # noqa: E402
from spar_comm.kernels import passes  # noqa: E402
from test_collectives_mpi import integer_grads  # noqa: E402

COMM = MPI.COMM_WORLD
torch.set_num_threads(1)  # the ranks fill the cores already
SHAPES = [(7, 5), (5,), (30,), (4, 4), (11,)]  # registration order


class Controlled(torch.nn.Module):
    """Parameters whose gradients the test chooses: loss = sum(p * g)."""

    def __init__(self, shapes=SHAPES, dtype=torch.float32):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=dtype)) for s in shapes])

    def backward_with(self, grads) -> None:
        sum((p * torch.from_numpy(g).reshape(p.shape)).sum() for p, g in zip(self.ps, grads)).backward()


def rank_grads(seed: int, step: int, dtype=np.float32):
    """grads[rank][param]: every rank's gradients, known to all ranks, exact to sum."""
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = integer_grads(seed, step, COMM.size, sum(sizes), dtype)
    cuts = np.cumsum(sizes)[:-1]
    return [np.split(f, cuts) for f in flat]


def residuals_of(opt) -> list:
    return [bucket.reducer.residual_state()[1].copy() for bucket in opt.buckets]


def parameters_of(model) -> np.ndarray:
    return torch.cat([p.detach().flatten() for p in model.ps]).numpy().copy()


def wrap(model, topology, **options):
    options.setdefault("bucket_cap_mb", 40 * 4 / 2**20)  # about 40 floats: several buckets
    return sct.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5), model.named_parameters(),
                                    topology=topology, **options)


def bucket_gradient(opt, bucket) -> np.ndarray:
    return torch.cat([p.grad.flatten() for p in bucket.params]).numpy()


def bucket_of(grads_of_rank, model, bucket) -> np.ndarray:
    index = {id(p): i for i, p in enumerate(model.ps)}
    return np.concatenate([grads_of_rank[index[id(p)]] for p in bucket.params])


@pytest.mark.openmpi
@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, values, indices", [
    *((a, None, None) for a in reproducible()),
    *((a, "int8", "auto" if a in CODECS["indices"] else None) for a in CODECS["values"]),
])
def test_every_bucket_matches_the_serial_reference(topology, algorithm, values, indices):
    """With a codec too; ps.4's bucket is dense (dense=), where the value codec
    applies and the index codec does not."""
    model = Controlled()
    opt = wrap(model, topology, algorithm=algorithm, density=0.2, selector="exact", values=values, indices=indices,
               dense=["ps.4"])
    assert_all(COMM, len(opt.buckets) >= 2, f"{len(opt.buckets)} buckets")
    refs = [Reference(b.reducer.name, COMM.size, topology.emulated_ranks_per_node, sum(p.numel() for p in b.params),
                      "float32", 0.2, values=values) for b in opt.buckets]
    for step in range(3):
        grads = rank_grads(7, step)
        opt.zero_grad()
        model.backward_with(grads[COMM.rank])
        opt.synchronize()
        for bucket, ref in zip(opt.buckets, refs):
            expected = ref.step([bucket_of(g, model, bucket) for g in grads])
            got = bucket_gradient(opt, bucket)
            assert_all(COMM, np.array_equal(got, expected), f"step {step} bucket {bucket.index} differs")
            assert_all(COMM, np.array_equal(bucket.reducer.residual_full(), ref.residuals[COMM.rank]),
                       f"step {step} bucket {bucket.index}: residual differs")
            assert_identical_bits(COMM, got, "bucket gradient")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["topka", "hitopk"])
def test_the_density_set_between_steps_is_each_steps_with_nothing_rebuilt(topology, algorithm):
    """``optimizer.density`` moves up and down within max_density: each sparse
    bucket matches the reference at that step's density; the dense bucket
    (dense=) is untouched by it; the allreducers are the ones first made."""
    model = Controlled()
    opt = wrap(model, topology, algorithm=algorithm, density=0.1, max_density=0.5, selector="exact", dense=["ps.4"])
    made = [bucket.reducer for bucket in opt.buckets]
    refs = [Reference(b.reducer.name, COMM.size, topology.emulated_ranks_per_node, sum(p.numel() for p in b.params),
                      "float32", 0.1) for b in opt.buckets]
    for step, density in enumerate([0.1, 0.5, 0.05, 0.3]):
        opt.density = density
        grads = rank_grads(9, step)
        opt.zero_grad()
        model.backward_with(grads[COMM.rank])
        opt.step()  # the gradients stay the buckets' means
        for bucket, ref in zip(opt.buckets, refs):
            ref.density = density if bucket.reducer.sparse else 0.1
            expected = ref.step([bucket_of(g, model, bucket) for g in grads])
            assert_all(COMM, np.array_equal(bucket_gradient(opt, bucket), expected),
                       f"step {step} (density {density}) bucket {bucket.index} differs")
            assert_all(COMM, np.array_equal(bucket.reducer.residual_full(), ref.residuals[COMM.rank]),
                       f"step {step} bucket {bucket.index}: residual differs")
    assert_all(COMM, [bucket.reducer for bucket in opt.buckets] == made, "an allreducer was rebuilt")
    assert_all(COMM, any(not b.reducer.sparse for b in opt.buckets) and any(b.reducer.sparse for b in opt.buckets),
               "the test needs a dense bucket and a sparse one")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_set_different_densities_are_refused_at_step_on_every_rank(topology):
    model = Controlled()
    opt = wrap(model, topology, algorithm="hitopk", density=0.1, max_density=0.5, selector="exact")
    opt.density = 0.2 if COMM.rank == 0 else 0.3
    model.backward_with(rank_grads(3, 0)[COMM.rank])
    before = parameters_of(model)
    with pytest.raises(ConfigError, match="different densities"):
        opt.step()
    assert_all(COMM, np.array_equal(parameters_of(model), before), "a refused step moved the parameters")


@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", reproducible())
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_parameters_get_the_float32_reference_rounded_once(topology, algorithm, dtype):
    """A 16-bit gradient is reduced in float32 and rounded once: the serial
    reference run on the float32 values of the 16-bit gradients, then cast."""
    model = Controlled(dtype=dtype)
    opt = wrap(model, topology, algorithm=algorithm, density=0.2, selector="exact")
    refs = [Reference(algorithm, COMM.size, topology.emulated_ranks_per_node, sum(p.numel() for p in b.params),
                      "float32", 0.2) for b in opt.buckets]
    for step in range(2):
        grads = [[torch.from_numpy(g).to(dtype).float().numpy() for g in mine] for mine in rank_grads(5, step)]
        opt.zero_grad()
        model.backward_with(grads[COMM.rank])  # autograd rounds each gradient to the parameter's dtype: exactly these
        opt.synchronize()
        for bucket, ref in zip(opt.buckets, refs):
            expected = torch.from_numpy(ref.step([bucket_of(g, model, bucket) for g in grads])).to(dtype)
            got = torch.cat([p.grad.flatten() for p in bucket.params])
            assert_all(COMM, got.dtype == dtype and torch.equal(got, expected),
                       f"step {step} bucket {bucket.index} differs")
            assert_all(COMM, np.array_equal(bucket.reducer.residual_full(), ref.residuals[COMM.rank]),
                       f"step {step} bucket {bucket.index}: residual differs")
            assert_identical_bits(COMM, got.view(torch.int16).numpy(), "bucket gradient")


@pytest.mark.mpi(min_size=1)
def test_dense_gives_the_mean_of_the_ranks_gradients_to_the_bit(topology):
    model = Controlled(dtype=torch.float64)
    opt = wrap(model, topology, algorithm="dense")
    grads = rank_grads(3, 0, np.float64)
    model.backward_with(grads[COMM.rank])
    opt.step()  # synchronizes, then SGD with lr 0.5 from zero weights: p = -0.5 * mean
    for i, p in enumerate(model.ps):
        mean = sum(g[i] for g in grads) / COMM.size  # rank order; exact sums, one rounding
        assert_all(COMM, np.array_equal(p.grad.numpy().ravel(), mean), f"parameter {i}: grad is not the mean")
        assert_all(COMM, np.array_equal(p.detach().numpy().ravel(), -0.5 * mean), f"parameter {i}: step")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm", ["topka", "gtopk", "hitopk", "hitopk_leader"])
def test_sparse_buckets_conserve_gradient_mass(topology, algorithm):
    model = Controlled(dtype=torch.float64)
    opt = wrap(model, topology, algorithm=algorithm, density=0.05)
    raw = [np.zeros(sum(p.numel() for p in b.params)) for b in opt.buckets]
    applied = [np.zeros_like(r) for r in raw]
    for step in range(4):
        grads = rank_grads(11, step, np.float64)
        opt.zero_grad()
        model.backward_with(grads[COMM.rank])
        opt.synchronize()
        for b, bucket in enumerate(opt.buckets):
            raw[b] += sum(bucket_of(g, model, bucket) for g in grads)
            applied[b] += bucket_gradient(opt, bucket) * COMM.size
    for b, bucket in enumerate(opt.buckets):
        residuals = COMM.allreduce(bucket.reducer.residual_full(), op=MPI.SUM)
        assert_all(COMM, np.allclose(applied[b] + residuals, raw[b], rtol=0, atol=1e-9),
                   f"bucket {b}: applied + residuals != raw gradients")


@pytest.mark.mpi(min_size=1)
def test_a_bucket_starts_while_backward_is_still_running(topology):
    """The hook of the first layer (whose gradient comes last) holds backward
    until the last layer's bucket has started: it can only start if buckets
    overlap backward. Nothing here depends on how fast the machine is."""
    layers = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = sct.DistributedOptimizer(torch.optim.SGD(layers.parameters(), lr=0.1), layers.named_parameters(),
                                   topology=topology, algorithm="hitopk", density=0.1, bucket_cap_mb=33 * 32 * 4 / 2**20)
    started_in_backward = []

    def hold(_):
        deadline = time.monotonic() + 30
        while "start" not in opt.bucket_timings()[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        started_in_backward.append("start" in opt.bucket_timings()[0])

    layers[0].weight.register_post_accumulate_grad_hook(hold)
    loss = layers(torch.randn(16, 32)).square().mean()
    loss.backward()
    opt.synchronize()
    times = opt.bucket_timings()  # reset by synchronize: check what the hold saw
    assert_all(COMM, started_in_backward == [True], "bucket 0 had not started while backward waited")
    assert_all(COMM, len(opt.buckets) >= 3, f"{len(opt.buckets)} buckets")
    assert_all(COMM, times == [{}] * len(opt.buckets), "timings not reset by synchronize")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["dense", "hitopk"])
def test_gradients_become_views_of_the_buckets_and_zeroing_them_in_place_changes_no_bit(topology, algorithm):
    """As DDP's gradient_as_bucket_view: after the allreduce each .grad lies in
    its bucket; zero_grad(set_to_none=False) zeroes it there, backward adds
    into the bucket itself, and the result is the same bits as with fresh
    gradients."""
    models = [Controlled(), Controlled()]
    opts = [wrap(m, topology, algorithm=algorithm, density=0.2, selector="exact") for m in models]
    for step in range(3):
        grads = rank_grads(11, step)
        opts[0].zero_grad()
        opts[1].zero_grad(set_to_none=False)
        for model, opt in zip(models, opts):
            model.backward_with(grads[COMM.rank])
            opt.step()
        for fresh, in_place in zip(opts[0].buckets, opts[1].buckets):
            assert_all(COMM, np.array_equal(bucket_gradient(opts[0], fresh), bucket_gradient(opts[1], in_place)),
                       f"step {step} bucket {fresh.index}: zeroing in place changed the result")
        for bucket in opts[1].buckets:
            for view, p in zip(bucket.views, bucket.params):
                assert_all(COMM, p.grad.data_ptr() == view.data_ptr() and p.grad.shape == p.shape,
                           f"step {step}: a .grad is not its bucket's view")
        assert_identical_bits(COMM, torch.cat([p.detach().flatten() for p in models[1].ps]).numpy(), "parameters")
        assert_all(COMM, all(torch.equal(a, b) for a, b in zip(models[0].ps, models[1].ps)),
                   f"step {step}: the parameters differ")


@pytest.mark.mpi(min_size=1)
def test_accumulates_backward_passes_before_one_allreduce(topology):
    model = Controlled(dtype=torch.float64)
    opt = wrap(model, topology, algorithm="dense", backward_passes_per_step=2)
    first, second = rank_grads(5, 0, np.float64), rank_grads(5, 1, np.float64)
    model.backward_with(first[COMM.rank])
    assert_all(COMM, all(t == {} for t in opt.bucket_timings()), "a bucket started after one of two passes")
    model.backward_with(second[COMM.rank])
    opt.synchronize()
    for i, p in enumerate(model.ps):
        mean = sum(a[i] + b[i] for a, b in zip(first, second)) / COMM.size
        assert_all(COMM, np.array_equal(p.grad.numpy().ravel(), mean), f"parameter {i}")
    # A third pass before step() on one rank only: refused on every rank, nothing hangs.
    model.backward_with(first[COMM.rank])
    if COMM.rank == COMM.size - 1:
        model.backward_with(first[COMM.rank])
    model.backward_with(second[COMM.rank])
    with pytest.raises(ConfigError, match="backward_passes_per_step=2"):
        opt.step()


@pytest.mark.mpi(min_size=1)
def test_parameters_named_dense_are_never_sparsified(topology):
    model = Controlled(dtype=torch.float64)
    opt = wrap(model, topology, algorithm="hitopk", density=0.01, dense=["ps.2", model.ps[4]])
    kinds = {n: b.reducer.name for b in opt.buckets for n in b.names}
    assert_all(COMM, kinds["ps.2"] == kinds["ps.4"] == "dense", f"{kinds}")
    assert_all(COMM, {kinds[f"ps.{i}"] for i in (0, 1, 3)} == {"hitopk"}, f"{kinds}")
    grads = rank_grads(9, 0, np.float64)
    model.backward_with(grads[COMM.rank])
    opt.synchronize()
    for i in (2, 4):
        mean = sum(g[i] for g in grads) / COMM.size
        assert_all(COMM, np.array_equal(model.ps[i].grad.numpy().ravel(), mean), f"ps.{i} is not the exact mean")


def digits_like(step: int):
    rng = np.random.default_rng([COMM.rank, step])
    return torch.from_numpy(rng.standard_normal((8, 12)).astype(np.float32)), torch.from_numpy(rng.integers(0, 4, 8))


def small_net(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))


def train_steps(net, opt, steps):
    """Steps on digits-like batches, on the device of ``net``'s parameters."""
    device = next(net.parameters()).device
    for step in steps:
        x, y = digits_like(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x.to(device)), y.to(device)).backward()
        opt.step()


def make_run(topology, seed=0):
    """A small net where ``topology``'s memory computes, and its optimizer."""
    net = small_net(seed).to(tensor_device(topology.memory))
    sct.broadcast_parameters(net)
    opt = sct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net.named_parameters(),
                                   topology=topology, algorithm="hitopk", density=0.1, bucket_cap_mb=0.001)
    return net, opt


def straight_and_saved(topology) -> tuple:
    """The parameters of a run of 6 steps, and a second run's state after 3
    (its model's, its optimizer's, and the optimizer itself)."""
    net, opt = make_run(topology)
    train_steps(net, opt, range(6))
    straight = torch.cat([p.detach().flatten() for p in net.parameters()]).numpy().copy()
    net, opt = make_run(topology)
    train_steps(net, opt, range(3))
    return straight, net.state_dict(), opt.state_dict(), opt


@pytest.mark.mpi(min_size=1)
def test_state_dict_round_trip_resumes_to_the_same_bits(topology):
    straight, saved_model, saved_opt, _ = straight_and_saved(topology)
    assert_all(COMM, list(saved_opt["spar_comm"]["residuals"]) == [f"rank{COMM.rank}"], "not this rank's residuals only")
    net, opt = make_run(topology, seed=1)  # other weights and empty state, then loaded
    net.load_state_dict(saved_model)
    opt.load_state_dict(saved_opt)
    train_steps(net, opt, range(3, 6))
    resumed = torch.cat([p.detach().flatten() for p in net.parameters()]).numpy()
    assert_all(COMM, np.array_equal(straight, resumed), "resumed run differs from the one that never stopped")
    assert_identical_bits(COMM, resumed, "parameters")


def shared_directory(tmp_path_factory):
    """A directory every rank sees: rank 0's."""
    return COMM.bcast(str(tmp_path_factory.mktemp("state")) if COMM.rank == 0 else None)


@pytest.mark.mpi(min_size=1)
def test_rank_0s_torch_save_loaded_by_every_rank_is_refused_naming_the_ways_that_scale(topology, tmp_path_factory):
    """The recipe "rank 0 saves, every rank loads that file" would give every
    other rank rank 0's residuals: refused on every rank alike, naming
    torch.distributed.checkpoint and a file per rank, nothing loaded. A
    world of one keeps the recipe; a file per rank loads on every rank."""
    net, opt = make_run(topology)
    train_steps(net, opt, range(2))
    folder = shared_directory(tmp_path_factory)
    if COMM.rank == 0:
        torch.save(opt.state_dict(), f"{folder}/optimizer.pt")
    torch.save(opt.state_dict(), f"{folder}/optimizer.rank{COMM.rank}.pt")
    COMM.Barrier()
    net, fresh = make_run(topology, seed=1)
    before = residuals_of(fresh)
    if COMM.size == 1:
        fresh.load_state_dict(torch.load(f"{folder}/optimizer.pt"))
    else:
        with pytest.raises(ConfigError) as refused:
            fresh.load_state_dict(torch.load(f"{folder}/optimizer.pt"))
        message = str(refused.value)
        assert_all(COMM, len(set(COMM.allgather(message))) == 1, "the ranks were told different things")
        assert message.startswith(f"rank{'s 1 to' if COMM.size > 2 else ''} {COMM.size - 1}: the state_dict holds "
                                  "the residuals of rank0"), message
        for named in ("torch.distributed.checkpoint.save", "torch.distributed.checkpoint.load",
                      "torch.save each rank's own state_dict() to a file per rank"):
            assert named in message, message
        assert_all(COMM, all(np.array_equal(a, b) for a, b in zip(residuals_of(fresh), before)),
                   "a refused load changed a residual")
        fresh.load_state_dict(torch.load(f"{folder}/optimizer.rank{COMM.rank}.pt"))
    assert_all(COMM, all(np.array_equal(a, b) for a, b in zip(residuals_of(fresh), residuals_of(opt))),
               "this rank's residuals did not come back")


@pytest.mark.mpi(min_size=1)
def test_a_state_of_an_unread_format_is_refused_by_name(topology):
    """Formats 1 (every rank's residuals, a list by rank) and 2 were never
    released: such a state is refused on every rank, naming its format and
    the one read, and nothing is loaded."""
    _, _, saved_opt, _ = straight_and_saved(topology)
    net, opt = make_run(topology, seed=1)
    before = residuals_of(opt)
    for old in (1, 2):
        saved_opt["spar_comm"]["format"] = old
        with pytest.raises(ConfigError) as refused:
            opt.load_state_dict(saved_opt)
        message = str(refused.value)
        assert_all(COMM, len(set(COMM.allgather(message))) == 1, "the ranks were told different things")
        assert f"is of format {old}, which this version does not read: it reads format {sct.STATE_FORMAT}" in message
        assert_all(COMM, all(np.array_equal(a, b) for a, b in zip(residuals_of(opt), before)),
                   "a refused load changed a residual")


@pytest.mark.mpi(min_size=2)
def test_state_of_another_layout_is_refused_on_every_rank(topology):
    net, opt = make_run(topology)
    state = opt.state_dict()
    other = torch.nn.Sequential(torch.nn.Linear(12, 25), torch.nn.ReLU(), torch.nn.Linear(25, 4))
    wrapped = sct.DistributedOptimizer(torch.optim.SGD(other.parameters(), lr=0.1), other.named_parameters(),
                                       topology=topology, algorithm="hitopk", density=0.1, bucket_cap_mb=0.001)
    with pytest.raises(ConfigError, match="buckets"):
        wrapped.load_state_dict(state)
    state["spar_comm"]["world_size"] += 1
    with pytest.raises(ConfigError, match=f"saved by {COMM.size + 1} ranks"):
        opt.load_state_dict(state)
    with pytest.raises(ConfigError, match="no spar_comm entry"):
        opt.load_state_dict(torch.optim.SGD(net.parameters(), lr=0.1).state_dict())


@pytest.mark.mpi(min_size=2)
def test_an_auto_state_of_a_job_that_chose_otherwise_is_refused_naming_the_choice(monkeypatch):
    """auto times the link at the start: a job that timed 1 Tbit/s where the
    saved one timed 10 Mbit/s chooses other allreducers, and is told so on
    every rank; a job that chose alike takes the state."""
    monkeypatch.delenv(ENV_CALIBRATION, raising=False)

    def job(gbps):
        monkeypatch.setattr(probe, "time_link", lambda round_trip: (1e-4 if gbps < 1 else 1e-6, gbps_to_beta(gbps)))
        topology = Topology(ranks_per_node=1)
        net = small_net()
        opt = sct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                       topology=topology, algorithm="auto", density=0.1, bucket_cap_mb=0.001)
        return net, opt

    net, slow = job(0.01)
    train_steps(net, slow, range(2))
    state = slow.state_dict()
    _, fast = job(1000)
    chosen = [[b.reducer.name for b in opt.buckets] for opt in (slow, fast)]
    assert_all(COMM, chosen[0] != chosen[1], f"auto chose {chosen} at both links: the test shows nothing")
    with pytest.raises(ConfigError, match="algorithm='auto' chose .* in the saved job"):
        fast.load_state_dict(state)
    _, again = job(0.01)
    again.load_state_dict(state)
    state["spar_comm"]["algorithms"] = 7 if COMM.rank == COMM.size - 1 else state["spar_comm"]["algorithms"]
    with pytest.raises(ConfigError, match="algorithms are not"):  # one rank's bad copy: a verdict on every rank
        again.load_state_dict(state)


@pytest.mark.mpi(min_size=2)
def test_a_state_with_a_damaged_residual_is_refused_on_every_rank(topology):
    """Each rank checks its own residuals, and the ranks agree: one verdict on
    every rank, naming the last rank, though only the last rank's is bad."""
    net, opt = make_run(topology)
    train_steps(net, opt, range(2))
    state = opt.state_dict()
    mine = state["spar_comm"]["residuals"][f"rank{COMM.rank}"]
    span, values = mine["bucket0"]
    assert len(values) > 0
    last = COMM.rank == COMM.size - 1
    if last:
        mine["bucket0"] = (span, torch.full_like(values, float("nan")))
    with pytest.raises(ConfigError, match=f"rank {COMM.size - 1}: .*residual of this rank, bucket 0, is not finite"):
        opt.load_state_dict(state)
    if last:
        del state["spar_comm"]["residuals"][f"rank{COMM.rank}"]["bucket0"]
    with pytest.raises(ConfigError, match=f"rank {COMM.size - 1}: .*residuals of this rank are not "):
        opt.load_state_dict(state)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", ["shape", "dtype"])
def test_a_different_model_on_one_rank_is_refused_on_every_rank(topology, case):
    odd = COMM.rank == COMM.size - 1
    width = 25 if case == "shape" and odd else 24
    dtype = torch.float64 if case == "dtype" and odd else torch.float32
    net = torch.nn.Sequential(torch.nn.Linear(12, width), torch.nn.Linear(width, 4)).to(dtype)
    with pytest.raises(ConfigError, match=f"rank {COMM.size - 1}"):
        sct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                 topology=topology, algorithm="hitopk")
    with pytest.raises(ConfigError, match="differ from rank 0"):
        sct.broadcast_parameters(net)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("setting", [{"non_finite": "raise"}, {"bucket_cap_mb": 1}, {"values": "int8"}])
def test_settings_that_differ_between_ranks_are_refused_as_a_whole_on_every_rank(topology, setting):
    """The settings are one value, compared across ranks before anything is
    built: also those no allreducer sees (the non-finite rule, bucketing)."""
    net = small_net(0)
    mine = setting if COMM.rank == COMM.size - 1 else {}
    with pytest.raises(ConfigError) as refused:
        sct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                 topology=topology, algorithm="hitopk", **mine)
    message = str(refused.value)
    assert_all(COMM, len(set(COMM.allgather(message))) == 1, "the ranks were told different things")
    name = next(iter(setting))
    assert message.startswith(f"ranks disagree on the DistributedOptimizer settings: {name}: "), message
    if name != "bucket_cap_mb":  # the optimizer's own
        with pytest.raises(ConfigError, match=f"ranks disagree on the comm_hook settings: {name}: "):
            sct.comm_hook("hitopk", 0.1, topology=topology, **mine)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("set_to_none", [True, False])
def test_a_nan_on_one_rank_is_a_nan_mean_on_every_rank_and_leaves_the_residuals(topology, set_to_none):
    """Found where the gradients are copied into their buckets (``set_to_none``:
    backward writes fresh ones), or by the allreducer's own pass where they
    accumulate in the buckets already."""
    model = Controlled()
    opt = wrap(model, topology, algorithm="hitopk", density=0.2)
    model.backward_with(rank_grads(2, 0)[COMM.rank])
    opt.step()
    kept = residuals_of(opt)
    grads = rank_grads(2, 1)
    if COMM.rank == 0:
        grads[0][1][0] = np.nan
    opt.zero_grad(set_to_none=set_to_none)
    with passes.counting() as books:
        model.backward_with(grads[COMM.rank])  # the gradients are reduced when backward returns
    checks = {name for name, _, _ in books} & {"copy", "finite"}
    assert_all(COMM, checks == {"copy" if set_to_none else "finite"}, f"the checks made: {checks}")
    for bucket, residual, was in zip(opt.buckets, residuals_of(opt), kept):
        poisoned = any(p is model.ps[1] for p in bucket.params)
        nan = [bool(torch.isnan(p.grad).all()) for p in bucket.params]
        assert_all(COMM, nan == [poisoned] * len(nan), f"bucket {bucket.index}: NaN where {nan}")
        if poisoned:
            assert_all(COMM, np.array_equal(residual, was), "the NaN bucket's residual changed")
    opt.step()


@pytest.mark.mpi(min_size=2)
def test_a_nan_on_one_rank_skips_the_step_on_every_rank_when_asked_to_raise(topology):
    model = Controlled()
    opt = wrap(model, topology, algorithm="hitopk", density=0.2, non_finite="raise")
    grads = rank_grads(2, 0)
    if COMM.rank == 0:
        grads[0][1][0] = np.nan
    model.backward_with(grads[COMM.rank])
    with pytest.raises(NonFiniteGradientError, match="rank 0: non-finite values"):
        opt.step()
    assert_all(COMM, all(not p.detach().any() for p in model.ps), "parameters changed by a refused step")
    opt.zero_grad()  # the next step works: no rank was stranded
    model.backward_with(rank_grads(2, 1)[COMM.rank])
    opt.step()
    assert_identical_bits(COMM, torch.cat([p.detach().flatten() for p in model.ps]).numpy(), "parameters")


@pytest.mark.mpi(min_size=1)
def test_misuse_is_named(topology):
    model = Controlled()
    with pytest.raises(ConfigError, match="dense= names no parameter: 'nope'"):
        wrap(model, topology, dense=["nope"])
    with pytest.raises(ConfigError, match="backward_passes_per_step"):
        wrap(model, topology, backward_passes_per_step=0)
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        wrap(model, topology, bucket_cap_mb=0)
    with pytest.raises(ConfigError, match="float16 and bfloat16"):
        wrap(Controlled(dtype=torch.complex64), topology)
    with pytest.raises(ConfigError, match="non_finite must be one of 'propagate', 'raise', got 'skip'"):
        wrap(model, topology, non_finite="skip")
    opt = wrap(model, topology, algorithm="dense", overlap=False)
    model.backward_with(rank_grads(1, 0)[COMM.rank])
    with pytest.raises(RuntimeError, match="in flight"):
        opt.zero_grad()
    opt.step()
    opt.zero_grad()
    model.backward_with(rank_grads(1, 1)[COMM.rank])
    opt.synchronize()
    with pytest.warns(UserWarning, match="skip_synchronize"):  # Horovod's recipe, half followed
        opt.step()
    model.backward_with(rank_grads(1, 2)[COMM.rank])
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()  # the recipe
        model.backward_with(rank_grads(1, 3)[COMM.rank])
        opt.step()  # backward, then step
    assert [str(w.message) for w in caught] == []


@pytest.mark.mpi(min_size=1)
def test_powersgd_compresses_each_layer_and_keeps_every_rank_alike(topology):
    """algorithm="powersgd": the buckets' allreducers see the layers' shapes (a
    weight is a matrix, a bias is summed densely), training lowers the loss,
    and every rank holds the same parameters."""
    net = small_net(0)
    sct.broadcast_parameters(net)
    opt = sct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9), net.named_parameters(),
                                   topology=topology, algorithm="powersgd")
    shapes = [shape for bucket in opt.buckets for shape in bucket.reducer.options["shapes"]]
    assert_all(COMM, sorted(shapes) == sorted(tuple(p.shape) for p in net.parameters()), f"bucket shapes {shapes}")
    batches = [digits_like(step) for step in range(40)]

    def loss() -> float:  # over every rank's batches
        with torch.no_grad():
            mine = sum(float(torch.nn.functional.cross_entropy(net(x), y)) for x, y in batches) / len(batches)
        return COMM.allreduce(mine) / COMM.size

    before = loss()
    train_steps(net, opt, range(40))
    after = loss()
    assert_all(COMM, after < before, f"loss {before:.4f} -> {after:.4f}")
    assert_identical_bits(COMM, torch.cat([p.detach().flatten() for p in net.parameters()]).numpy(), "parameters")


@pytest.mark.mpi(min_size=2)
def test_a_launcher_whose_ranks_are_not_mpis_is_refused_on_every_rank(monkeypatch):
    model = Controlled()
    monkeypatch.setenv("WORLD_SIZE", str(COMM.size))
    monkeypatch.setenv("RANK", str(COMM.size - 1 - COMM.rank))  # the same processes in another order: taken
    sct.broadcast_parameters(model)
    monkeypatch.setenv("RANK", "0")  # every process says it is rank 0
    try:
        sct.broadcast_parameters(model)
        problem = "no error"
    except ConfigError as error:
        problem = str(error)
    expected = ("spar_comm.torch.broadcast_parameters: MPI's world and the torch job hold different processes "
                "(MPI rank 0 is torch rank 0, MPI rank 1 is torch rank 0")
    assert_all(COMM, problem.startswith(expected), problem)


AMP_CASES = [("dense", {}), ("topka", {}), ("hitopk", {}), ("hitopk", {"values": "int8"})]


def amp_step(model, opt, scaler, grads, recipe: str) -> None:
    """One step under GradScaler, loss = sum(p * g): the plain recipe, or
    Horovod's (synchronize, unscale, step inside skip_synchronize)."""
    opt.zero_grad()
    loss = sum((p * torch.from_numpy(g).reshape(p.shape)).sum() for p, g in zip(model.ps, grads))
    scaler.scale(loss).backward()
    if recipe == "horovod":
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
    else:
        scaler.step(opt)
    scaler.update()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("recipe, overlap", [("plain", True), ("horovod", True), ("plain", False)],
                         ids=["plain", "horovod", "plain-no-overlap"])
@pytest.mark.parametrize("algorithm, settings", AMP_CASES, ids=["dense", "topka", "hitopk", "hitopk-int8"])
def test_an_overflow_on_one_rank_is_skipped_by_grad_scaler_on_every_rank(topology, algorithm, settings, recipe,
                                                                           overlap):
    """Steps 0, an overflow on rank 0, 2, against steps 0 and 2 alone: the
    overflow halves the scale on every rank and changes no parameter and no
    residual, and the run goes on to the bits of the run without it (the scale
    is a power of two: every scaled sum, selection and mean is exact to it)."""
    runs = []
    for steps in ([0, "overflow", 2], [0, 2]):
        model = Controlled()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        opt = wrap(model, topology, algorithm=algorithm, density=0.2, grad_scaler=scaler, overlap=overlap,
                   **settings)
        for step in steps:
            grads = rank_grads(21, 1 if step == "overflow" else step)[COMM.rank]
            if step != "overflow":
                amp_step(model, opt, scaler, grads, recipe)
                continue
            before = parameters_of(model), residuals_of(opt), scaler.get_scale()
            if COMM.rank == 0:
                grads[2][3] = np.inf
            amp_step(model, opt, scaler, grads, recipe)
            assert_all(COMM, scaler.get_scale() == before[2] / 2, f"scale {scaler.get_scale()} after {before[2]}")
            assert_all(COMM, np.array_equal(parameters_of(model), before[0]), "the skipped step moved a parameter")
            assert_all(COMM, all(np.array_equal(a, b) for a, b in zip(residuals_of(opt), before[1])),
                       "the skipped step changed a residual")
        saved = opt.state_dict()["spar_comm"]["residuals"][f"rank{COMM.rank}"]
        runs.append((parameters_of(model), [saved[f"bucket{i}"][1].numpy() for i in range(len(saved))]))
    assert_identical_bits(COMM, runs[0][0], "parameters")
    assert_all(COMM, np.array_equal(runs[0][0], runs[1][0]), "the parameters differ from the run without the overflow")
    assert_all(COMM, all(np.array_equal(a, b) for a, b in zip(runs[0][1], runs[1][1])),
               "the residuals differ from the run without the overflow")


@pytest.mark.mpi(min_size=1)
def test_unscaling_before_clipping_sees_the_mean(topology):
    model = Controlled(dtype=torch.float64)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = wrap(model, topology, algorithm="dense", grad_scaler=scaler)
    grads = rank_grads(4, 0, np.float64)
    loss = sum((p * torch.from_numpy(g).reshape(p.shape)).sum() for p, g in zip(model.ps, grads[COMM.rank]))
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    for i, p in enumerate(model.ps):
        mean = sum(g[i] for g in grads) / COMM.size
        assert_all(COMM, np.array_equal(p.grad.numpy().ravel(), mean), f"parameter {i}: not the unscaled mean")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    assert_identical_bits(COMM, parameters_of(model), "parameters")


@pytest.mark.mpi(min_size=1)
def test_grad_scaler_with_error_feedback_must_be_named(topology):
    model = Controlled()
    scaler = torch.amp.GradScaler("cpu")
    opt = wrap(model, topology, algorithm="hitopk", density=0.2)
    amp = [g for g in rank_grads(4, 0)[COMM.rank]]
    with pytest.raises(ConfigError, match="needs grad_scaler="):
        amp_step(model, opt, scaler, amp, "plain")
    assert_all(COMM, not parameters_of(model).any(), "a refused step moved a parameter")


@pytest.mark.mpi(min_size=2)
def test_an_amp_run_resumes_with_its_scale_to_the_same_bits(topology):
    """The checkpoint recipe under GradScaler: the optimizer's and the scaler's
    state dicts. Saved after an overflow (the scale halved), resumed in a new
    optimizer and scaler: the same bits as the run that never stopped."""
    def start():
        model = Controlled()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        return model, scaler, wrap(model, topology, algorithm="hitopk", density=0.2, grad_scaler=scaler)

    def run(model, scaler, opt, steps):
        for step in steps:
            grads = rank_grads(23, step)[COMM.rank]
            if step == 1 and COMM.rank == 0:
                grads[2][3] = np.inf
            amp_step(model, opt, scaler, grads, "plain")

    straight = start()
    run(*straight, range(4))
    first = start()
    run(*first, range(2))
    saved = {"model": first[0].state_dict(), "optimizer": first[2].state_dict(), "scaler": first[1].state_dict()}
    resumed = start()
    resumed[0].load_state_dict(saved["model"])
    resumed[2].load_state_dict(saved["optimizer"])
    resumed[1].load_state_dict(saved["scaler"])
    assert_all(COMM, resumed[1].get_scale() == 2.0**9, f"the resumed scale is {resumed[1].get_scale()}")
    run(*resumed, range(2, 4))
    assert_all(COMM, np.array_equal(parameters_of(straight[0]), parameters_of(resumed[0])),
               "the resumed run differs from the one that never stopped")


@pytest.mark.mpi(min_size=2)
def test_auto_values_take_int8_over_a_slow_link_and_a_state_of_another_choice_is_refused(monkeypatch):
    """``values="auto"`` prices each bucket's codec with its algorithm: int8
    over 10 Mbit/s, the sum's own values over 1 Tbit/s. A job that chose
    other codecs than the saved one refuses its state by name (it would not
    go on to the same bits, and a dense bucket keeps a residual through a
    lossy codec alone); a job that chose alike takes it."""
    monkeypatch.delenv(ENV_CALIBRATION, raising=False)

    def job(gbps):
        monkeypatch.setattr(probe, "time_link", lambda round_trip: (1e-4 if gbps < 1 else 1e-6, gbps_to_beta(gbps)))
        net = small_net()
        opt = sct.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1), net.named_parameters(),
                                       topology=Topology(ranks_per_node=1), algorithm="hitopk", density=0.1,
                                       values="auto", bucket_cap_mb=0.001)
        return net, opt

    net, slow = job(0.01)
    train_steps(net, slow, range(2))
    _, fast = job(1000)
    codecs = [[b.reducer.settings.values for b in opt.buckets] for opt in (slow, fast)]
    assert_all(COMM, "int8" in codecs[0] and set(codecs[1]) == {None}, f"auto chose {codecs}")
    assert_all(COMM, len({repr(c) for c in COMM.allgather(codecs)}) == 1, "ranks chose different codecs")
    state = slow.state_dict()
    with pytest.raises(ConfigError, match="values='auto' chose .* in the saved job"):
        fast.load_state_dict(state)
    _, again = job(0.01)
    again.load_state_dict(state)
    assert_all(COMM, all(map(np.array_equal, residuals_of(again), residuals_of(slow))), "the residuals not taken")
