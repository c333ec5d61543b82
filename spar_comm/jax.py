"""spar_comm for JAX: the sparse allreduce as an optax gradient transformation.

    tx = optax.chain(sparse_allreduce("hitopk", density=0.01), optax.sgd(0.1))
    state = tx.init(params)                          # collective: every rank calls it
    updates, state = tx.update(grads, state)         # under jax.jit too

The gradient pytree is fused into one flat vector (leaves in ``jax.tree_util``
order) and reduced on the host by one allreducer, called through an *ordered*
``io_callback``: inside a jitted step it runs where the program puts it, after
everything before it, so every rank issues its collectives in the same order.
The optax state holds this rank's error-feedback residual, so a checkpoint of
the state resumes to the same bits. jax and optax are imported here only.
"""
from __future__ import annotations

import contextlib
import functools
import math
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.flatten_util import ravel_pytree

from .collectives import Allreducer
from .costmodel.auto import make_allreducer
from .collectives.checks import DTYPES
from .collectives.feedback import Residual
from .consensus import raise_if_any
from .errors import GradientError, SparCommError
from .launch import abort_job
from .topology import Topology

#: One leaf of a pytree as the fused buffer sees it: (key path, shape, dtype name).
Leaf = Tuple[str, Tuple[int, ...], str]


class SparseAllreduceState(NamedTuple):
    """This rank's error-feedback residual: what selection kept back, over the
    positions ``[span[0], span[1])`` of the fused vector that this rank owns
    (empty for dense algorithms or without error feedback). Both may differ
    between ranks; restoring a state saved on another rank or layout raises
    ConfigError on every rank."""

    residual: jax.Array
    span: jax.Array


class ScheduledSparseAllreduceState(NamedTuple):
    """``SparseAllreduceState`` and the number of updates made, from which a
    density schedule gives each update's density (as optax's ``count`` gives
    a learning rate schedule's step)."""

    residual: jax.Array
    span: jax.Array
    count: jax.Array


def sparse_allreduce(
    algorithm: str = "hitopk",
    density: Union[float, Callable[[int], Any]] = 0.001,
    *,
    max_density: Optional[float] = None,
    selector: str = "mstopk",
    topology: Optional[Topology] = None,
    error_feedback: bool = True,
    average: bool = True,
    selector_options: Optional[Dict[str, Any]] = None,
    values: Optional[str] = None,
    indices: Optional[str] = None,
    **options: Any,
) -> optax.GradientTransformation:
    """An optax transformation that replaces each gradient by its (sparsified) mean over all ranks.

    Args:
        algorithm, selector, error_feedback, average, selector_options, values,
            indices, options: as for ``spar_comm.make_allreducer``: one
            allreducer for the fused vector of every leaf.
        density: a number, or a schedule as optax's learning rates are (a
            function of the update's number, traced like theirs), each value
            at most ``max_density`` (required then: it sizes the buffers).
        topology: default: nodes found by shared memory or ``SPAR_COMM_RANKS_PER_NODE``.

    Returns:
        ``optax.GradientTransformation``. ``init(params)`` is collective and
        checks that every rank has the same tree, shapes and one dtype
        (float32, float64, float16 or bfloat16; a 16-bit one is reduced in
        float32 and rounded back once; a mixed tree is refused, never cast).
        ``update(grads, state, params=None)`` works eagerly and under
        ``jax.jit``, at the same point of every rank's program; the residual
        lives in the state (a ``ScheduledSparseAllreduceState`` under a
        schedule, which counts the updates).

    Raises:
        ConfigError: from ``init`` on every rank, for bad settings or trees.
        GradientError: from ``update`` on every rank, where any rank's gradient
            differs from the parameters (NonFiniteGradientError for NaN or
            Inf), wrapped by JAX in a ``JaxRuntimeError``: ``unwrap_errors()``
            gives back spar_comm's. The state is unchanged, so the step can be skipped.

    Example:
        >>> tx = optax.chain(sparse_allreduce("hitopk", density=0.01), optax.sgd(0.1))
        >>> state = tx.init(params)
        >>> updates, state = tx.update(grads, state, params)
    """
    bound = _Bound(topology)
    schedule = density if callable(density) else None

    def init(params: Any) -> SparseAllreduceState:
        if bound.topology is None:
            bound.topology = Topology()
        topology = bound.topology
        leaves = _leaves(params)
        raise_if_any(topology.world, _dtype_problem(leaves))
        on_rank0 = topology.world.bcast(leaves, root=0)
        mismatch = _mismatch(leaves, on_rank0)
        raise_if_any(topology.world, mismatch and f"the parameters differ from rank 0's: {mismatch}")
        size = sum(math.prod(shape) for _, shape, _ in leaves)
        dtype = leaves[0][2] if leaves else "float32"
        unbounded = schedule is not None and max_density is None
        raise_if_any(topology.world, "a density schedule needs max_density=, the most it returns (the buffers are "
                     "sized for it)" if unbounded else None)
        first = _density_of(schedule(0)) if schedule else density
        reducer = make_allreducer(algorithm, topology, size, dtype, first, selector, error_feedback=error_feedback,
                                  average=average, selector_options=selector_options, values=values, indices=indices,
                                  max_density=max_density, **options)
        if bound.reducer is not None:  # a jitted step traced before still works with it
            bound.reducer.free()
        bound.reducer, bound.leaves = reducer, leaves
        span, residual = reducer.residual_state()
        residual, span = jnp.asarray(residual), jnp.asarray(span, dtype=jnp.int32)
        if schedule:
            return ScheduledSparseAllreduceState(residual, span, jnp.zeros((), jnp.int32))
        return SparseAllreduceState(residual=residual, span=span)

    def update(updates: Any, state: SparseAllreduceState, params: Any = None) -> Tuple[Any, SparseAllreduceState]:
        del params
        reducer = bound.reducer
        if reducer is None:
            raise RuntimeError("sparse_allreduce: call init(params) on every rank before update")
        mismatch = _mismatch(_leaves(updates), bound.leaves)
        problem = mismatch and f"the gradient differs from the parameters given to init: {mismatch}"
        flat, unravel = ravel_pytree(updates)
        # The shapes are this rank's own, so a refused gradient still traces; it
        # is refused on every rank when the callback runs.
        count = getattr(state, "count", jnp.zeros((), jnp.int32))
        now = jnp.asarray(schedule(count) if schedule else 0, jnp.float32)  # traced, as optax's schedules are
        mean, residual = io_callback(
            functools.partial(_reduce_on_host, reducer, problem, schedule),
            (jax.ShapeDtypeStruct(flat.shape, flat.dtype),
             jax.ShapeDtypeStruct(state.residual.shape, state.residual.dtype)),
            flat,
            state.residual,
            state.span,
            now,
            ordered=True,
        )
        if schedule:
            return unravel(mean), ScheduledSparseAllreduceState(residual, state.span, count + 1)
        return unravel(mean), SparseAllreduceState(residual=residual, span=state.span)

    return optax.GradientTransformation(init, update)


class _Bound:
    """What ``init`` built for a transformation: the topology, the allreducer,
    and the parameters' fused layout that gradients must match."""

    def __init__(self, topology: Optional[Topology]):
        self.topology = topology
        self.reducer: Optional[Allreducer] = None
        self.leaves: Tuple[Leaf, ...] = ()


@contextlib.contextmanager
def unwrap_errors() -> Iterator[None]:
    """Around a step: raise the spar_comm error (GradientError,
    NonFiniteGradientError, ConfigError) that JAX wrapped in a JaxRuntimeError,
    which keeps only its text. Every rank raises alike."""
    _raised.clear()
    try:
        yield
    except RuntimeError as wrapper:  # jax.errors.JaxRuntimeError, or XlaRuntimeError in older JAX
        error = _raised.pop() if _raised else None
        if error is not None and str(error) in str(wrapper):
            raise error from wrapper
        raise


#: The spar_comm error of the last failed callback, for ``unwrap_errors``.
_raised: list = []


def _reduce_on_host(reducer: Allreducer, problem: Optional[str], schedule: Optional[Callable[[int], Any]],
                    flat: np.ndarray, residual: np.ndarray, span: np.ndarray,
                    now: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """One update on the host: allreduce with the state's residual (a writable
    copy of it: JAX's arrays are not), at the schedule's density ``now``
    where there is a schedule; hand back the mean and the new residual. The
    allreducer checks the state and the density with the gradient, in its one
    per-call collective. A gradient found wrong while tracing is withheld, so
    that the allreducer refuses it on every rank; the reason found while
    tracing then replaces the allreducer's. The hot path thus adds no
    collective of its own."""
    world = reducer.topology.world
    try:
        state = Residual(tuple(span.tolist()), np.array(residual))
        density = _density_of(now) if schedule else None
        try:
            mean = reducer.allreduce(_WITHHELD if problem else np.asarray(flat), residual=state, density=density)
        except GradientError:  # raised on every rank alike, so every rank is here
            raise_if_any(world, problem, GradientError)
            raise
        return mean, state.values
    except SparCommError as error:  # raised on every rank alike: the step fails everywhere
        _raised[:] = [error]
        raise
    except BaseException:  # this rank alone: the others wait in a collective
        abort_job(world, "spar_comm.jax sparse_allreduce update")


def _density_of(value: Any) -> float:
    """A schedule's float32 value as the decimal it stands for (0.001, not
    0.0010000000474974513), so that k is the one the decimal gives."""
    return float(str(np.float32(value)))


#: What a rank passes instead of a gradient found wrong while tracing: every
#: allreducer refuses it (none has size 0).
_WITHHELD = np.empty(0, np.float32)


def _leaves(tree: Any) -> Tuple[Leaf, ...]:
    """The fused buffer's view of a pytree, in ``jax.tree_util`` order."""
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    return tuple(
        (jax.tree_util.keystr(path), tuple(np.shape(leaf)), np.dtype(jnp.result_type(leaf)).name)
        for path, leaf in with_paths
    )


def _mismatch(leaves: Tuple[Leaf, ...], expected: Tuple[Leaf, ...]) -> Optional[str]:
    """The first difference between two fused layouts, in words, or None."""
    if len(leaves) != len(expected):
        return f"{len(leaves)} leaves where {len(expected)} were expected"
    for (path, shape, dtype), (want_path, want_shape, want_dtype) in zip(leaves, expected):
        if (path, shape, dtype) != (want_path, want_shape, want_dtype):
            return (f"leaf {path or '(root)'} is {dtype}{list(shape)} where "
                    f"{want_path or '(root)'} {want_dtype}{list(want_shape)} was expected")
    return None


def _dtype_problem(leaves: Tuple[Leaf, ...]) -> Optional[str]:
    dtypes = sorted({dtype for _, _, dtype in leaves})
    if len(dtypes) <= 1 and set(dtypes) <= set(DTYPES):
        return None
    return (f"sparse_allreduce fuses every leaf into one {' or '.join(DTYPES)} buffer; "
            f"the parameters have leaves of dtype {', '.join(dtypes)} (cast them to one of those)")
