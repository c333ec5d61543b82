"""spar_comm.torch's DDP communication hook under MPI, on gloo with CPU tensors:
the dense hook against DDP's own mean, conservation of gradient mass through
DDP's bucket rebuild, training, the state through a save and load, bucket
order, and bad input on one rank. At most 3 ranks (one node, two, and nodes
of unequal size in ``make test``): DDP on gloo is slow to start, and nothing
here needs more."""
from __future__ import annotations

import numpy as np
import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import spar_comm.torch as sct  # noqa: E402
from mpi_helpers import assert_all, assert_identical_bits  # noqa: E402
from spar_comm import ConfigError, NonFiniteGradientError, Topology  # noqa: E402
from reference import k_of  # noqa: E402
from test_collectives_mpi import integer_grads  # noqa: E402

COMM = MPI.COMM_WORLD
torch.set_num_threads(1)
pytestmark = [pytest.mark.worlds(1, 3), pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")]
DDP = torch.nn.parallel.DistributedDataParallel
SHAPES = [(7, 5), (40,), (30,), (4, 4), (11,), (9, 3)]  # registration order
CAP_MB = 48 * 8 / 2**20  # about 48 float64 values a bucket: several buckets


@pytest.fixture(scope="module")
def topology():
    """torch.distributed from the MPI launch, and the topology of the launch's emulated nodes."""
    sct.init_process_group("gloo")
    topo = Topology()
    yield topo
    topo.free()
    dist.destroy_process_group()


class Chosen(torch.nn.Module):
    """Parameters whose gradients the test chooses: forward(grads) = sum(p * g),
    the terms made in ``order`` (which sets the order backward finishes them in,
    and so DDP's rebuilt buckets)."""

    def __init__(self, order=None):
        super().__init__()
        self.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(s, dtype=torch.float64)) for s in SHAPES])
        self.order = list(range(len(SHAPES))) if order is None else order

    def forward(self, grads):
        return sum((self.ps[i] * grads[i].reshape(self.ps[i].shape)).sum() for i in self.order)


def chosen_grads(seed: int, step: int):
    """grads[rank][param] as float64 tensors: integers times 2**-6, exact to sum."""
    sizes = [int(np.prod(s)) for s in SHAPES]
    flat = integer_grads(seed, step, COMM.size, sum(sizes), np.float64)
    return [[torch.from_numpy(g) for g in np.split(f, np.cumsum(sizes)[:-1])] for f in flat]


def hooked(model, algorithm="hitopk", density=0.1, topology=None, settings=None, **options):
    """``model`` in DDP (``options``) with spar_comm's hook (``settings``: its codecs and options)."""
    options.setdefault("bucket_cap_mb", CAP_MB)
    ddp = DDP(model, **options)
    state, hook = sct.comm_hook(algorithm, density, topology=topology, **(settings or {}))
    ddp.register_comm_hook(state, hook)
    return ddp, state


def flat(tensors) -> np.ndarray:
    return torch.cat([t.detach().flatten() for t in tensors]).numpy()


def residual_sums(state, params) -> np.ndarray:
    """Every rank's residual summed, in the order of ``params``."""
    mine = state.residuals()
    parts = [mine.get(state._coordinates[id(p)], np.zeros(p.numel())) for p in params]
    return COMM.allreduce(np.concatenate(parts), op=MPI.SUM)


@pytest.mark.mpi(min_size=1)
def test_the_dense_hook_gives_ddps_own_mean(topology):
    """Several buckets, through the rebuild: the gradients DDP applies match its
    own allreduce's to float rounding (it sums in another order)."""
    torch.manual_seed(0)
    nets = [torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 24), torch.nn.Tanh(),
                                torch.nn.Linear(24, 4)) for _ in range(2)]
    nets[1].load_state_dict(nets[0].state_dict())
    ours, state = hooked(nets[0], "dense", topology=topology, bucket_cap_mb=0.001)
    theirs = DDP(nets[1], bucket_cap_mb=0.001)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    rng = np.random.default_rng(COMM.rank)
    for step in range(3):
        x = torch.from_numpy(rng.standard_normal((8, 12)).astype(np.float32))
        for model, opt in zip((ours, theirs), opts):
            opt.zero_grad()
            model(x).square().mean().backward()
        got, want = flat(p.grad for p in ours.parameters()), flat(p.grad for p in theirs.parameters())
        assert_all(COMM, np.allclose(got, want, rtol=1e-6, atol=1e-8), f"step {step}: {np.abs(got - want).max()}")
        assert_identical_bits(COMM, got, "reduced gradients")
        for opt in opts:
            opt.step()
    assert_all(COMM, len(state.buckets) >= 2, f"{len(state.buckets)} buckets")


@pytest.mark.mpi(min_size=1)
def test_the_density_set_between_iterations_is_each_iterations_and_conserves(topology):
    """``state.density`` moves within max_density: each bucket picks k at that
    iteration's density, on the allreducer made for it (once DDP has rebuilt
    its buckets); applied plus kept is what came in."""
    model = Chosen()
    ddp, state = hooked(model, "topka", density=0.05, topology=topology, settings={"max_density": 0.5})
    params = list(model.ps)
    raw, applied, made = np.zeros(sum(p.numel() for p in params)), 0, {}
    for step, density in enumerate([0.05, 0.5, 0.1, 0.3]):
        state.density = density
        grads = chosen_grads(13, step)
        ddp.zero_grad()
        ddp(grads[COMM.rank]).backward()
        raw += sum(flat(g) for g in grads)
        applied = applied + flat(p.grad for p in params) * COMM.size
        for index, bucket in state.buckets.items():
            assert_all(COMM, bucket.reducer.last["k"] == k_of(density, bucket.reducer.size),
                       f"step {step}: bucket {index} picked {bucket.reducer.last['k']} at density {density}")
            if step > 0:  # after DDP's own rebuild of its buckets, in the second iteration
                assert_all(COMM, made.setdefault(index, bucket.reducer) is bucket.reducer, "an allreducer was rebuilt")
        assert_identical_bits(COMM, flat(p.grad for p in params), "gradients")
        assert_all(COMM, np.allclose(applied + residual_sums(state, params), raw, rtol=0, atol=1e-9),
                   f"step {step}: applied + residuals != raw gradients")


@pytest.mark.mpi(min_size=2)
def test_ranks_that_set_different_densities_are_refused_out_of_backward_on_every_rank(topology):
    model = Chosen()
    ddp, state = hooked(model, "hitopk", density=0.05, topology=topology, settings={"max_density": 0.5})
    state.density = 0.1 if COMM.rank == 0 else 0.2
    with pytest.raises(ConfigError, match="different densities"):
        ddp(chosen_grads(2, 0)[COMM.rank]).backward()
    state.density = 0.2  # agreed again: DDP and the hook go on
    ddp.zero_grad()
    ddp(chosen_grads(2, 1)[COMM.rank]).backward()
    assert_identical_bits(COMM, flat(p.grad for p in model.ps), "gradients after the refusal")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm, settings", [
    *((a, {}) for a in ["topka", "gtopk", "hitopk", "hitopk_leader"]),
    ("hitopk", {"values": "int8", "indices": "auto"}), ("dense", {"values": "int8"}), ("powersgd", {"rank": 2}),
    ("auto", {}),
], ids=str)
def test_compressed_buckets_conserve_gradient_mass_through_the_rebuild(topology, algorithm, settings):
    """Applied updates plus every rank's residuals equal the raw gradients'
    sum after every step. Backward finishes the parameters in registration
    order, so DDP's rebuilt buckets differ from its first ones and residuals
    move between allreducers: those of top-k selection, of a lossy codec,
    and of PowerSGD's factors alike."""
    model = Chosen(order=list(reversed(range(len(SHAPES)))))
    ddp, state = hooked(model, algorithm, density=0.05, topology=topology, settings=settings)
    params = list(model.ps)
    raw = np.zeros(sum(p.numel() for p in params))
    applied = np.zeros_like(raw)
    layouts = []
    for step in range(4):
        grads = chosen_grads(11, step)
        ddp.zero_grad()
        ddp(grads[COMM.rank]).backward()
        raw += sum(flat(g) for g in grads)
        applied += flat(p.grad for p in params) * COMM.size
        layouts.append(sorted(tuple(b.key) for b in state.buckets.values()))
        assert_all(COMM, np.allclose(applied + residual_sums(state, params), raw, rtol=0, atol=1e-9),
                   f"step {step}: applied + residuals != raw gradients")
    assert_all(COMM, layouts[0] != layouts[1] == layouts[3], "DDP did not rebuild its buckets as expected")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_buckets_get_the_mean_rounded_once(topology, dtype):
    """The dense hook on 16-bit parameters: the mean over ranks of the 16-bit
    gradients, reduced in float32 and rounded once to the parameters' dtype."""
    model = Chosen()
    model.to(dtype)
    ddp, state = hooked(model, "dense", topology=topology)
    for step in range(2):
        grads = [[g.to(dtype) for g in mine] for mine in chosen_grads(5, step)]
        ddp.zero_grad()
        ddp(grads[COMM.rank]).backward()
        wide = sum(torch.cat([g.double().flatten() for g in mine]) for mine in grads) / COMM.size
        got = torch.cat([p.grad.flatten() for p in model.ps])
        assert_all(COMM, got.dtype == dtype and torch.equal(got, wide.to(dtype)), f"step {step}: not the mean")
        assert_identical_bits(COMM, got.view(torch.int16).numpy(), "reduced 16-bit gradients")


@pytest.mark.mpi(min_size=1)
def test_a_model_of_several_buckets_trains(topology):
    torch.manual_seed(1)
    teacher = torch.nn.Linear(16, 4)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                              torch.nn.Linear(32, 4))
    ddp, state = hooked(net, "hitopk", density=0.1, topology=topology, bucket_cap_mb=0.002)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    rng = np.random.default_rng(COMM.rank)
    losses = []
    for _ in range(60):
        x = torch.from_numpy(rng.standard_normal((16, 16)).astype(np.float32))
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), teacher(x).detach())
        loss.backward()
        opt.step()
        losses.append(COMM.allreduce(loss.item()) / COMM.size)
    first, last = np.mean(losses[:5]), np.mean(losses[-5:])
    assert_all(COMM, len(state.buckets) >= 2, f"{len(state.buckets)} buckets")
    assert_all(COMM, last < 0.3 * first, f"loss {first:.4f} -> {last:.4f}")
    assert_identical_bits(COMM, flat(net.parameters()), "parameters")


def run_chosen(topology, steps, state_dict=None):
    """A fresh process's run as far as this test can tell: a new model, DDP and
    hook. Returns the model, optimizer, hook state and the gradients applied
    (summed over ranks and steps)."""
    model = Chosen(order=list(reversed(range(len(SHAPES)))))
    ddp, state = hooked(model, "hitopk", density=0.05, topology=topology)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.25, momentum=0.9)
    if state_dict is not None:
        model.load_state_dict(state_dict["model"])
        opt.load_state_dict(state_dict["opt"])
        state.load_state_dict(state_dict["hook"])
    applied = 0
    for step in steps:
        opt.zero_grad()
        ddp(chosen_grads(5, step)[COMM.rank]).backward()
        applied = applied + flat(p.grad for p in model.ps) * COMM.size
        opt.step()
    return model, opt, state, applied


@pytest.mark.mpi(min_size=1)
def test_the_state_survives_a_save_and_load_and_the_bucket_rebuild(topology):
    """The state round-trips to the bit, and a resumed run loses no residual:
    applied gradients before and after the resume plus the final residuals
    equal the raw gradients' sum, although the resumed process's DDP reduces
    its first step in other buckets than the ones the residuals were saved from."""
    model, opt, state, before = run_chosen(topology, range(3))
    saved = {"model": model.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()}
    assert_all(COMM, list(saved["hook"]["residuals"]) == [f"rank{COMM.rank}"], "not this rank's residuals only")
    assert_all(COMM, np.abs(residual_sums(state, list(model.ps))).sum() > 0, "no residual to carry")
    fresh = sct.comm_hook("hitopk", 0.05, topology=topology)[0]
    fresh.load_state_dict(saved["hook"])
    again = fresh.state_dict()["residuals"][f"rank{COMM.rank}"]
    mine = saved["hook"]["residuals"][f"rank{COMM.rank}"]
    same = len(again) == len(mine) == len(state.residuals()) and all(
        a[:2] == b[:2] and torch.equal(a[2], b[2]) for a, b in zip(again, mine))
    assert_all(COMM, same, "the state changed in a save and load")

    model, _, state, after = run_chosen(topology, range(3, 5), saved)
    raw = sum(flat(g) for step in range(5) for g in chosen_grads(5, step))
    total = before + after + residual_sums(state, list(model.ps))
    assert_all(COMM, np.allclose(total, raw, rtol=0, atol=1e-9), "residual mass lost in the resume")
    assert_identical_bits(COMM, flat(model.ps), "parameters")


@pytest.mark.mpi(min_size=1)
def test_rank_0s_saved_hook_state_loaded_by_every_rank_is_refused_and_so_is_format_1(topology, tmp_path_factory):
    """The recipe "rank 0 saves, every rank loads that file" would give every
    other rank rank 0's residuals: refused on every rank alike, naming
    torch.distributed.checkpoint and a file per rank (a world of one keeps
    it). A state of format 1 (every rank's residuals), never released, is
    refused by name."""
    model, _, state, _ = run_chosen(topology, range(2))
    kept = state.residuals()
    folder = COMM.bcast(str(tmp_path_factory.mktemp("hook")) if COMM.rank == 0 else None)
    if COMM.rank == 0:
        torch.save(state.state_dict(), f"{folder}/hook.pt")
    COMM.Barrier()
    fresh = sct.comm_hook("hitopk", 0.05, topology=topology)[0]
    if COMM.size == 1:
        fresh.load_state_dict(torch.load(f"{folder}/hook.pt"))
    else:
        with pytest.raises(ConfigError) as refused:
            fresh.load_state_dict(torch.load(f"{folder}/hook.pt"))
        message = str(refused.value)
        assert_all(COMM, len(set(COMM.allgather(message))) == 1, "the ranks were told different things")
        assert "the hook state holds the residuals of rank0" in message, message
        for named in ("torch.distributed.checkpoint.save", "torch.distributed.checkpoint.load",
                      "torch.save each rank's own state_dict() to a file per rank"):
            assert named in message, message
        assert_all(COMM, not fresh._loaded, "a refused load took residuals")
    old = {"format": 1, "world_size": COMM.size, "algorithm": "hitopk",
           "residuals": COMM.allgather({c: torch.from_numpy(v) for c, v in kept.items()})}
    fresh = sct.comm_hook("hitopk", 0.05, topology=topology)[0]
    with pytest.raises(ConfigError, match="the hook state is of format 1, which this version does not read: it "
                                          "reads format 2"):
        fresh.load_state_dict(old)
    assert_all(COMM, not fresh._loaded, "a refused load took residuals")


class StubBucket:
    """What the hook reads of DDP's GradBucket."""

    def __init__(self, index, last, values, params):
        self._index, self._last, self._buffer, self._params = index, last, values, params

    def index(self):
        return self._index

    def is_last(self):
        return self._last

    def buffer(self):
        return self._buffer

    def parameters(self):
        return self._params


@pytest.mark.mpi(min_size=2)
def test_buckets_are_reduced_in_index_order_whatever_order_they_come_in(topology):
    """Every rank hands the hook its buckets in another order: the collectives
    still match (no hang, no mix-up), and each bucket gets its exact mean."""
    sizes = [30, 7, 19, 12]
    params = [torch.zeros(n, dtype=torch.float32) for n in sizes]
    state, hook = sct.comm_hook("dense", topology=topology)
    for step in range(2):
        grads = [integer_grads(3, 10 * step + b, COMM.size, n, np.float32) for b, n in enumerate(sizes)]
        order = np.random.default_rng([COMM.rank, step]).permutation(len(sizes))
        futures = {}
        for b in order:
            stub = StubBucket(int(b), b == len(sizes) - 1, torch.from_numpy(grads[b][COMM.rank].copy()), [params[b]])
            futures[b] = hook(state, stub)
        for b, future in futures.items():
            mean = sum(grads[b]) / np.float32(COMM.size)
            assert_all(COMM, np.array_equal(future.wait().numpy(), mean), f"step {step}, bucket {b}")


@pytest.mark.mpi(min_size=2)
def test_a_bucket_that_differs_between_ranks_is_refused_on_every_rank(topology):
    """The hook's own check, on every rank, when a bucket's parameters differ
    in shape. (DDP compares the models when it is built, but not on every
    rank: ``sct.broadcast_parameters(model)`` before DDP refuses on all.)"""
    state, hook = sct.comm_hook("hitopk", topology=topology)
    shape = (5, 4) if COMM.rank == COMM.size - 1 else (4, 5)
    stub = StubBucket(0, True, torch.ones(20), [torch.zeros(shape)])
    with pytest.raises(ConfigError, match="DDP bucket 0"):
        hook(state, stub).wait()


@pytest.mark.mpi(min_size=2)
def test_a_nan_on_one_rank_is_a_nan_bucket_on_every_rank(topology):
    model = Chosen()
    ddp, state = hooked(model, "hitopk", density=0.1, topology=topology)
    ddp(chosen_grads(2, 0)[COMM.rank]).backward()
    kept = state.residuals()
    grads = chosen_grads(2, 1)[COMM.rank]
    if COMM.rank == COMM.size - 1:
        grads[1][3] = np.nan
    ddp.zero_grad()
    ddp(grads).backward()
    nan = [bool(torch.isnan(p.grad).all()) for p in model.ps]
    assert_all(COMM, nan[1] and not all(nan), f"NaN gradients: {nan}")  # the bucket of parameter 1, not all
    poisoned = state._coordinates[id(model.ps[1])]
    assert_all(COMM, np.array_equal(kept[poisoned], state.residuals()[poisoned]), "the NaN bucket's residual changed")


@pytest.mark.mpi(min_size=2)
def test_a_nan_raised_out_of_backward_leaves_ddp_usable(topology):
    """non_finite="raise": NonFiniteGradientError itself out of backward() on
    every rank, after DDP finished its iteration, so the next one runs."""
    ddp, _ = hooked(Chosen(), "dense", density=1.0, topology=topology, settings={"non_finite": "raise"})
    for step in range(3):
        grads = chosen_grads(2, step)[COMM.rank]
        if step == 1 and COMM.rank == COMM.size - 1:
            grads[1][3] = np.nan
        ddp.zero_grad()
        if step == 1:
            with pytest.raises(NonFiniteGradientError, match=f"rank {COMM.size - 1}: non-finite values"):
                ddp(grads).backward()
            continue
        ddp(grads).backward()
        mean = [sum(g[i] for g in chosen_grads(2, step)) / COMM.size for i in range(len(SHAPES))]
        assert_all(COMM, all(np.array_equal(p.grad.numpy(), m.numpy().reshape(p.shape))
                             for p, m in zip(ddp.module.ps, mean)), f"step {step}: not the mean")


AMP_CASES = [("dense", {}), ("topka", {}), ("hitopk", {}), ("hitopk", {"values": "int8"})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("algorithm, settings", AMP_CASES, ids=["dense", "topka", "hitopk", "hitopk-int8"])
def test_an_overflow_on_one_rank_is_skipped_by_grad_scaler_on_every_rank(topology, algorithm, settings):
    """Steps 0, an overflow on the last rank, 2, against steps 0 and 2 alone:
    the overflow halves the scale on every rank and changes no parameter and
    no residual, and the run goes on to the bits of the run without it."""
    runs = []
    for steps in ([0, "overflow", 2], [0, 2]):
        model = Chosen()
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
        ddp, state = hooked(model, algorithm, density=0.1, topology=topology,
                            settings={"grad_scaler": scaler, **settings})
        opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
        for step in steps:
            grads = chosen_grads(21, 1 if step == "overflow" else step)[COMM.rank]
            if step == "overflow":
                before = flat(model.ps).copy(), state.residuals(), scaler.get_scale()
                if COMM.rank == COMM.size - 1:
                    grads[2][3] = np.inf
            opt.zero_grad()
            scaler.scale(ddp(grads)).backward()
            scaler.step(opt)
            scaler.update()
            if step == "overflow":
                now = state.residuals()
                assert_all(COMM, scaler.get_scale() == before[2] / 2, f"scale {scaler.get_scale()}")
                assert_all(COMM, np.array_equal(flat(model.ps), before[0]), "the skipped step moved a parameter")
                assert_all(COMM, before[1].keys() == now.keys()
                           and all(np.array_equal(before[1][c], now[c]) for c in now), "a residual changed")
        runs.append((flat(model.ps).copy(), state.residuals()))
    assert_identical_bits(COMM, runs[0][0], "parameters")
    assert_all(COMM, np.array_equal(runs[0][0], runs[1][0]), "the parameters differ from the run without the overflow")
    assert_all(COMM, runs[0][1].keys() == runs[1][1].keys()
               and all(np.array_equal(runs[0][1][c], runs[1][1][c]) for c in runs[0][1]),
               "the residuals differ from the run without the overflow")


@pytest.mark.slow
@pytest.mark.usefixtures("fast_simulator")
@pytest.mark.mpi(min_size=1)
def test_the_hook_on_the_gpu_path_gives_the_cpu_paths_bits(topology):
    """The hook on ``gpu-simulator`` (CUDA tensors on a GPU machine): DDP's
    buckets through the device path give the CPU hook's bits, rebuild included."""
    pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")
    from test_gpu_path_mpi import gpu_device

    gpu = Topology(device=gpu_device())
    device = sct.local_device() if gpu_device() == "gpu" else torch.device("cpu")
    runs = [(hooked(Chosen(order=list(reversed(range(len(SHAPES))))).to(where), "hitopk", density=0.05,
                    topology=t)[0], where) for t, where in ((topology, "cpu"), (gpu, device))]
    for step in range(2):  # the first layout, then the rebuilt one
        grads = chosen_grads(17, step)[COMM.rank]
        seen = []
        for ddp, where in runs:
            ddp.zero_grad()
            ddp([g.to(where) for g in grads]).backward()
            seen.append(flat(p.grad.cpu() for p in ddp.parameters()))
        assert_all(COMM, np.array_equal(*seen), f"step {step}: the GPU path's gradients differ")
    gpu.free()
