"""spar_comm.jax on one process: the transformation's plumbing (eager use, dtypes,
order of calls, error unwrapping). Collective behaviour is in test_jax_mpi.py."""
from __future__ import annotations

import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=false")

import pytest

jax = pytest.importorskip("jax")
optax = pytest.importorskip("optax")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from conftest import ROOT, find_mpiexec  # noqa: E402
from spar_comm import ConfigError, NonFiniteGradientError, Topology  # noqa: E402
from spar_comm.jax import SparseAllreduceState, sparse_allreduce, unwrap_errors  # noqa: E402


@pytest.fixture(scope="module")
def lone():
    topo = Topology(ranks_per_node=1)
    yield topo
    topo.free()


def test_eager_update_on_one_rank_keeps_tree_and_values(lone):
    """Without jit; on one rank the dense mean is the gradient itself, in the
    gradient's own tree, shapes and dtype."""
    grads = {"a": jnp.arange(6.0).reshape(2, 3), "b": (jnp.ones(2), jnp.full((), 3.0))}
    tx = sparse_allreduce("dense", topology=lone)
    state = tx.init(grads)
    assert isinstance(state, SparseAllreduceState) and state.residual.shape == (0,)
    mean, _ = tx.update(grads, state)
    assert jax.tree_util.tree_structure(mean) == jax.tree_util.tree_structure(grads)
    for got, want in zip(jax.tree_util.tree_leaves(mean), jax.tree_util.tree_leaves(grads)):
        assert got.shape == want.shape and got.dtype == want.dtype
        assert np.array_equal(np.asarray(got), np.asarray(want))


def test_sparse_keeps_the_rest_in_the_state(lone):
    """topka keeping 1 of 4: what is not sent stays in the state's residual and
    is added to the next gradient, until it wins (ties go to the lower position)."""
    tx = sparse_allreduce("topka", 0.25, topology=lone, selector="exact")
    grads = {"w": jnp.asarray([1.0, -4.0, 2.0, 0.5])}
    state = tx.init(grads)
    update = jax.jit(tx.update)
    sent, residuals = [], []
    for _ in range(3):
        mean, state = update(grads, state)
        sent.append(np.asarray(mean["w"]).tolist())
        residuals.append(np.asarray(state.residual).tolist())
    assert sent == [[0, -4, 0, 0], [0, -4, 0, 0], [0, 0, 6, 0]]
    assert residuals == [[1, 0, 2, 0.5], [2, 0, 4, 1], [3, -4, 0, 1.5]]
    assert np.asarray(state.span).tolist() == [0, 4]


def test_float64_with_x64(lone):
    with jax.enable_x64(True):
        grads = {"w": jnp.asarray([0.1, 0.2], jnp.float64)}
        tx = sparse_allreduce("dense", topology=lone)
        mean, _ = jax.jit(tx.update)(grads, tx.init(grads))
        assert mean["w"].dtype == jnp.float64 and np.array_equal(np.asarray(mean["w"]), [0.1, 0.2])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_16_bit_gradients_pass_through_with_a_float32_residual(lone, dtype):
    """Reduced in float32, rounded once: the sent value 1/3 + 1/3 comes back as
    the 16-bit rounding of its float32 sum, and the residual stays float32."""
    tx = sparse_allreduce("topka", 0.5, topology=lone, selector="exact")
    grads = {"w": jnp.asarray([1 / 3, -4.0, 0.25, 0.5], dtype)}
    state = tx.init(grads)
    assert state.residual.dtype == jnp.float32
    update = jax.jit(tx.update)
    mean, state = update(grads, state)
    mean, state = update(grads, state)
    third = np.float32(np.asarray(grads["w"][0], np.float32))
    assert mean["w"].dtype == dtype
    assert np.asarray(mean["w"]).tolist() == np.asarray([third + third, -4, 0, 0], np.float32).astype(dtype).tolist()
    assert np.asarray(state.residual).tolist() == [0, 0, 0.5, 0.5]


@pytest.mark.parametrize("params, match", [
    ({"w": jnp.zeros(2), "h": jnp.zeros(2, jnp.bfloat16)}, "leaves of dtype bfloat16, float32"),
    ({"h": jnp.zeros(2, jnp.int32)}, "leaves of dtype int32"),
    ({}, "size must be a positive integer, got 0"),
])
def test_parameters_that_cannot_be_fused_are_refused(lone, params, match):
    with pytest.raises(ConfigError, match=match):
        sparse_allreduce("hitopk", topology=lone).init(params)


def test_bad_settings_are_refused_at_init(lone):
    with pytest.raises(ConfigError, match="unknown algorithm 'fast'"):
        sparse_allreduce("fast", topology=lone).init({"w": jnp.zeros(2)})
    with pytest.raises(ConfigError, match="density must be in"):
        sparse_allreduce("hitopk", 2.0, topology=lone).init({"w": jnp.zeros(2)})


def test_update_before_init_says_so(lone):
    with pytest.raises(RuntimeError, match="call init"):
        sparse_allreduce("dense", topology=lone).update({"w": jnp.zeros(2)}, None)


def test_unwrap_errors_gives_back_the_spar_comm_error_only(lone):
    tx = sparse_allreduce("dense", topology=lone)
    state = tx.init({"w": jnp.zeros(2)})
    update = jax.jit(tx.update)
    with pytest.raises(NonFiniteGradientError) as raised, unwrap_errors():
        update({"w": jnp.asarray([1.0, jnp.inf])}, state)
    assert isinstance(raised.value.__cause__, jax.errors.JaxRuntimeError)
    with pytest.raises(RuntimeError, match="unrelated"), unwrap_errors():
        raise RuntimeError("unrelated")
    mean, _ = update({"w": jnp.ones(2)}, state)  # the failed step left nothing behind
    assert np.array_equal(np.asarray(mean["w"]), [1.0, 1.0])


def test_composes_with_optax_chain(lone):
    tx = optax.chain(sparse_allreduce("dense", topology=lone), optax.sgd(0.5))
    params = {"w": jnp.ones(3)}
    state = tx.init(params)
    updates, state = jax.jit(tx.update)({"w": jnp.asarray([2.0, 4.0, -2.0])}, state, params)
    assert np.array_equal(np.asarray(optax.apply_updates(params, updates)["w"]), [0.0, -1.0, 2.0])



ABORT_SCRIPT = """
import os, sys
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from mpi4py import MPI
from spar_comm.jax import sparse_allreduce
from spar_comm.kernels import register

def fail_on_rank_1():
    if MPI.COMM_WORLD.rank == 1:
        raise MemoryError("injected on rank 1")

selector = "exact"
if sys.argv[1] == "selection":  # inside the allreduce
    register("broken", lambda: lambda x, k: fail_on_rank_1() or np.arange(k), exact=False)
    selector = "broken"
else:  # in the update's own host code, before the allreduce
    import spar_comm.jax
    make_state = spar_comm.jax.Residual
    spar_comm.jax.Residual = lambda *args: fail_on_rank_1() or make_state(*args)
tx = sparse_allreduce("topka", 0.1, selector=selector)
state = tx.init({"w": jnp.zeros(100)})
jax.jit(tx.update)({"w": jnp.ones(100)}, state)
print("not reached", flush=True)
"""


@pytest.mark.openmpi
@pytest.mark.slow
@pytest.mark.parametrize("where, message", [
    ("selection", "[rank 1] topka allreduce failed"),
    ("update", "[rank 1] spar_comm.jax sparse_allreduce update failed"),
])
def test_a_failure_on_one_rank_inside_the_callback_aborts_the_job(where, message):
    """Not a spar_comm error (a bug, memory): the others wait in a collective,
    so the whole job ends, from inside JAX's callback too."""
    result = subprocess.run([find_mpiexec(), "-n", "2", sys.executable, "-c", ABORT_SCRIPT, where], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr and "injected on rank 1" in result.stderr
    assert "not reached" not in result.stdout
