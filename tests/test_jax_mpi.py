"""spar_comm.jax.sparse_allreduce, the optax transformation, at the world size
mpiexec gave: against the serial reference, composed with optax, through a
checkpoint of its state, and with bad input on one rank."""
from __future__ import annotations

import os
import re
from pathlib import Path

# Single-threaded XLA operations: several ranks share few cores.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from mpi_helpers import REFERENCE_WORLDS, assert_all, assert_identical_bits# noqa: E402
from reference import Reference, reproducible  # noqa: E402
from spar_comm import ConfigError, GradientError, NonFiniteGradientError, Topology  # noqa: E402
from spar_comm.collectives.checks import CODECS  # noqa: E402
from spar_comm.jax import sparse_allreduce, unwrap_errors  # noqa: E402

COMM = MPI.COMM_WORLD
README = Path(__file__).resolve().parent.parent / "README.md"
#: A small model's parameter tree: 67 floats in three leaves (nested, so key paths matter).
SHAPES = {"dense": {"w": (8, 7), "b": (7,)}, "scale": (4,)}
SIZE = 67
STEPS = 3


def tree_of(flat: np.ndarray, shapes=SHAPES):
    """Cut a flat vector into the tree, in jax.tree_util order (as the transform fuses it)."""
    leaves, treedef = jax.tree_util.tree_flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    parts, start = [], 0
    for shape in leaves:
        count = int(np.prod(shape))
        parts.append(jnp.asarray(flat[start:start + count].reshape(shape)))
        start += count
    return jax.tree_util.tree_unflatten(treedef, parts)


def flat_of(tree) -> np.ndarray:
    return np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree_util.tree_leaves(tree)])


def rank_grads(seed: int, step: int, p: int) -> list:
    """Every rank's flat gradient, known to all: multiples of 2**-6 below 2**6, so
    sums over ranks and steps are exact in float32 whatever the order."""
    rng = np.random.default_rng([seed, step])
    return [(rng.integers(-(2**12), 2**12, SIZE) * 2.0**-6).astype(np.float32) for _ in range(p)]


def jitted_update(tx):
    return jax.jit(lambda grads, state: tx.update(grads, state))


def full_residual(state) -> np.ndarray:
    """This rank's residual in fused coordinates (zeros elsewhere)."""
    lo, hi = np.asarray(state.span).tolist()
    full = np.zeros(SIZE, np.float32)
    full[lo:hi] = np.asarray(state.residual)
    return full


@pytest.fixture(scope="module")
def nodes_of_two():
    topo = Topology(ranks_per_node=min(2, COMM.size))
    yield topo
    topo.free()


@pytest.mark.openmpi
@pytest.mark.worlds(*REFERENCE_WORLDS)
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm, values", [*((a, None) for a in reproducible()),
                                               *((a, "int8") for a in CODECS["values"])])
def test_matches_serial_reference(nodes_of_two, algorithm, values):
    """Under jit, every algorithm gives the reference's mean and keeps its
    residual in the optax state, to the bit (dense: the exact mean of the
    ranks' gradients), and so do the algorithms that take a value codec with
    int8 values. One node layout: test_collectives_mpi.py covers the others;
    this checks the fusion, the state and the callback around the allreducer."""
    p, rank = COMM.size, COMM.rank
    density, topology = 0.1, nodes_of_two
    tx = sparse_allreduce(algorithm, density, topology=topology, values=values)
    state = tx.init(tree_of(np.zeros(SIZE, np.float32)))
    update = jitted_update(tx)
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, SIZE, "float32", density, values=values)
    for step in range(STEPS):
        grads = rank_grads(1, step, p)
        mean, state = update(tree_of(grads[rank]), state)
        expected = ref.step(grads)
        assert_all(COMM, np.array_equal(flat_of(mean), expected), f"step {step}: mean differs from the reference")
        assert_all(COMM, np.array_equal(full_residual(state), ref.residuals[rank]),
                   f"step {step}: residual differs from the reference")
        assert_identical_bits(COMM, flat_of(mean), "mean")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("algorithm", ["topka", "hitopk"])
def test_a_density_schedule_gives_each_update_its_density(nodes_of_two, algorithm):
    """density= a schedule of the update's number (traced under jit, as optax's
    learning rates are): each update matches the reference at that update's
    density, on the one allreducer, and the state counts the updates."""
    p, rank, topology = COMM.size, COMM.rank, nodes_of_two
    densities = [0.3, 0.3, 0.05, 0.05]
    tx = sparse_allreduce(algorithm, lambda count: jnp.where(count < 2, 0.3, 0.05), max_density=0.3,
                          topology=topology, selector="exact")
    state = tx.init(tree_of(np.zeros(SIZE, np.float32)))
    update = jitted_update(tx)
    ref = Reference(algorithm, p, topology.emulated_ranks_per_node, SIZE, "float32", 0.3)
    for step, density in enumerate(densities):
        grads = rank_grads(4, step, p)
        mean, state = update(tree_of(grads[rank]), state)
        ref.density = density
        assert_all(COMM, np.array_equal(flat_of(mean), ref.step(grads)), f"step {step}: mean differs at {density}")
        assert_all(COMM, np.array_equal(full_residual(state), ref.residuals[rank]), f"step {step}: residual differs")
        assert int(state.count) == step + 1
    with pytest.raises(ConfigError, match="needs max_density"):
        sparse_allreduce(algorithm, lambda count: 0.1, topology=topology).init(tree_of(np.zeros(SIZE, np.float32)))


@pytest.mark.mpi(min_size=1)
def test_chain_with_sgd_keeps_ranks_identical(nodes_of_two):
    """optax.chain(sparse_allreduce, sgd) in a jitted step: the update is -lr
    times the reference mean, and parameters stay bit-identical on every rank."""
    p, rank, lr = COMM.size, COMM.rank, 0.125
    tx = optax.chain(sparse_allreduce("hitopk", 0.05, topology=nodes_of_two), optax.sgd(lr))
    params = tree_of(np.linspace(-1, 1, SIZE, dtype=np.float32))
    state = tx.init(params)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), updates, state

    ref = Reference("hitopk", p, nodes_of_two.emulated_ranks_per_node, SIZE, "float32", 0.05)
    for n in range(4):
        grads = rank_grads(2, n, p)
        params, updates, state = step(params, state, tree_of(grads[rank]))
        expected = np.float32(-lr) * ref.step(grads)
        assert_all(COMM, np.array_equal(flat_of(updates), expected), f"step {n}: update is not -lr * mean")
        assert_identical_bits(COMM, flat_of(params), f"parameters after step {n}")


@pytest.mark.mpi(min_size=1)
def test_restored_state_continues_to_the_same_bits(nodes_of_two):
    """A state saved as NumPy arrays and given to a new transform (a restarted
    job) continues exactly as the one that never stopped."""
    rank = COMM.rank
    tx = sparse_allreduce("hitopk", 0.1, topology=nodes_of_two)
    state = tx.init(tree_of(np.zeros(SIZE, np.float32)))
    update = jitted_update(tx)
    for step in range(2):
        _, state = update(tree_of(rank_grads(3, step, COMM.size)[rank]), state)
    saved = jax.tree_util.tree_map(np.array, state)  # what a checkpoint holds
    restarted = sparse_allreduce("hitopk", 0.1, topology=nodes_of_two)
    restarted.init(tree_of(np.zeros(SIZE, np.float32)))
    restored = jax.tree_util.tree_map(jnp.asarray, saved)
    update_restarted = jitted_update(restarted)
    for step in range(2, 4):
        grads = tree_of(rank_grads(3, step, COMM.size)[rank])
        mean, state = update(grads, state)
        mean_restored, restored = update_restarted(grads, restored)
        assert_all(COMM, np.array_equal(flat_of(mean), flat_of(mean_restored)), f"step {step}: mean differs")
        assert_all(COMM, np.array_equal(np.asarray(state.residual), np.asarray(restored.residual)),
                   f"step {step}: residual differs")
    assert_all(COMM, np.asarray(state.residual).any(), "no residual kept: the test checks nothing")


@pytest.mark.mpi(min_size=2)
def test_state_of_another_rank_is_refused_everywhere():
    """One node: hitopk residuals cover different shards, so a state restored on
    the wrong rank is refused with ConfigError on every rank."""
    topo = Topology(ranks_per_node=COMM.size)
    tx = sparse_allreduce("hitopk", 0.1, topology=topo)
    state = tx.init(tree_of(np.zeros(SIZE, np.float32)))
    theirs = COMM.allgather(jax.tree_util.tree_map(np.array, state))[(COMM.rank + 1) % COMM.size]
    with pytest.raises(ConfigError, match="the residual is not a Residual of this rank's span"), unwrap_errors():
        jitted_update(tx)(tree_of(rank_grads(4, 0, COMM.size)[COMM.rank]),
                          jax.tree_util.tree_map(jnp.asarray, theirs))
    topo.free()


def last_rank_differs(good, bad):
    return bad if COMM.rank == COMM.size - 1 else good


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("bad_params, match", [
    ({"dense": {"w": (7, 8), "b": (7,)}, "scale": (4,)}, r"leaf \['dense'\]\['w'\] is float32\[7, 8\]"),
    ({"dense": {"w": (8, 7), "b": (7,)}}, "2 leaves where 3 were expected"),
], ids=["shape", "structure"])
def test_different_parameters_on_one_rank_are_refused_everywhere(nodes_of_two, bad_params, match):
    shapes = last_rank_differs(SHAPES, bad_params)
    params = jax.tree_util.tree_map(jnp.zeros, shapes, is_leaf=lambda x: isinstance(x, tuple))
    with pytest.raises(ConfigError, match=match) as raised:
        sparse_allreduce("hitopk", 0.1, topology=nodes_of_two).init(params)
    assert f"rank {COMM.size - 1}:" in str(raised.value)


@pytest.mark.mpi(min_size=1)
def test_mixed_dtypes_are_refused_everywhere(nodes_of_two):
    params = {"w": jnp.zeros(3), "h": jnp.zeros(3, jnp.bfloat16)}
    with pytest.raises(ConfigError, match="bfloat16, float32"):
        sparse_allreduce("hitopk", 0.1, topology=nodes_of_two).init(params)


def grads_with(rank_change):
    """Step-0 gradients, changed by ``rank_change`` on the last rank."""
    grads = tree_of(rank_grads(5, 0, COMM.size)[COMM.rank])
    return rank_change(grads) if COMM.rank == COMM.size - 1 else grads


@pytest.fixture(scope="module")
def hitopk_update(nodes_of_two):
    """One transform and its jitted update for the bad-input tests (compiled once)."""
    tx = sparse_allreduce("hitopk", 0.1, topology=nodes_of_two)
    return tx.init(tree_of(np.zeros(SIZE, np.float32))), jitted_update(tx)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("change, error, match", [
    (lambda g: {**g, "scale": g["scale"].astype(jnp.bfloat16)}, GradientError,
     r"leaf \['scale'\] is bfloat16\[4\] where \['scale'\] float32\[4\] was expected"),
    (lambda g: {**g, "dense": {**g["dense"], "w": g["dense"]["w"].T}}, GradientError, r"float32\[7, 8\]"),
    (lambda g: {**g, "scale": g["scale"].at[2].set(jnp.nan)}, NonFiniteGradientError, "non-finite values"),
], ids=["dtype", "shape", "nan"])
def test_bad_gradient_on_one_rank_raises_everywhere_and_changes_nothing(nodes_of_two, hitopk_update, change,
                                                                         error, match):
    """The error reaches every rank (JaxRuntimeError from JAX; the spar_comm
    error itself through unwrap_errors), and the state is unchanged: the next
    good step gives the reference's bits as if the bad one never happened."""
    p, rank = COMM.size, COMM.rank
    state, update = hitopk_update
    with pytest.raises(error, match=match) as raised:
        with unwrap_errors():
            update(grads_with(change), state)
    if p > 1:
        assert f"rank {p - 1}:" in str(raised.value)
    with pytest.raises(jax.errors.JaxRuntimeError, match=error.__name__):
        update(grads_with(change), state)  # without unwrap_errors: JAX's wrapper, carrying the text
    ref = Reference("hitopk", p, nodes_of_two.emulated_ranks_per_node, SIZE, "float32", 0.1)
    grads = rank_grads(6, 0, p)
    mean, _ = update(tree_of(grads[rank]), state)
    assert_all(COMM, np.array_equal(flat_of(mean), ref.step(grads)), "the step after the refused one differs")


@pytest.mark.mpi(min_size=1)
def test_the_readme_example_trains():
    """The README's optax example, as written: it learns, and every rank ends
    with the same parameters."""
    block = re.search(r"<!-- jax-example:.*?-->\n```python\n(.*?)```", README.read_text(), re.S)
    assert block, "the README lost its JAX example"
    scope: dict = {}
    exec(compile(block.group(1), "README.md", "exec"), scope)  # noqa: S102 (our own README)
    loss = float(scope["loss"])
    assert_all(COMM, loss < 1e-3, f"loss {loss} after 100 steps (about 3 at the start)")
    assert_identical_bits(COMM, flat_of(scope["params"]), "parameters")
