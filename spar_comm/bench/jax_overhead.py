"""What the optax transformation costs on top of the allreducer it calls
(bench_jax.py): the jitted ``spar_comm.jax.sparse_allreduce`` update of a
one-leaf gradient against the same gradient through the allreducer alone,
alternating call by call. The difference is the host callback: the vector
to the host and back, the residual loaded and returned, JAX's dispatch."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from mpi4py import MPI

from ..costmodel.auto import make_allreducer
from ..jax import sparse_allreduce
from ..topology import Topology
from .timing import slowest_median


def measure(algorithm: str, size: int, density: float, topology: Topology, warmup: int, repeat: int) -> dict:
    """Median of the slowest rank's time per call: the jitted update and the allreducer alone, alternating."""
    world = topology.world
    grad = np.random.default_rng([size, world.rank]).standard_normal(size).astype(np.float32)
    tx = sparse_allreduce(algorithm, density, topology=topology)
    state = tx.init({"g": jnp.zeros(size, jnp.float32)})
    update = jax.jit(tx.update)
    tree = {"g": jnp.asarray(grad)}
    reducer = make_allreducer(algorithm, topology, size, "float32", density)
    out = np.empty_like(grad)

    def via_jax():
        nonlocal state
        mean, state = update(tree, state)
        jax.block_until_ready(mean)

    calls = (via_jax, lambda: reducer.allreduce(grad, out=out))
    times = np.zeros((repeat, len(calls)))
    for i in range(warmup + repeat):
        for j, call in enumerate(calls):
            world.Barrier()
            start = MPI.Wtime()
            call()
            if i >= warmup:
                times[i - warmup, j] = MPI.Wtime() - start
    jax_s, alone_s = slowest_median(world, times, axis=0)
    reducer.free()
    return {"algorithm": algorithm, "size": size, "jax_update_s": float(jax_s), "allreducer_s": float(alone_s),
            "overhead": float(jax_s / alone_s)}
