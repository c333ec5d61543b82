"""Run by ``tests/test_torchrun.py`` under torchrun: every reproducible
allreducer, with and without codecs, over torch.distributed's gloo group
(``spar_comm.torch.transport``) on every emulated node layout the world size
allows, against the serial reference to the last bit: output, residual, and
the same bits on every rank; the node's phase through its shared memory
(files in /dev/shm) and through the group's collectives; and ``auto``'s timing of the link over the
group, alike on every rank. Prints ``rank R: CASES cases, FAILURES failed``
and each failure.

``--device gpu`` hands the allreducers CuPy arrays (``--backend nccl`` or
gloo), and checks the bytes staged through the host: none where the group
takes device buffers (NCCL; gloo with ``SPAR_COMM_CUDA_AWARE=1``), some
where it does not."""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import numpy as np
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(__file__))
from mpi_helpers import layouts  # noqa: E402
from reference import Reference, reproducible  # noqa: E402
from spar_comm import Topology, make_allreducer  # noqa: E402
from spar_comm.collectives.checks import CODECS  # noqa: E402
from spar_comm.collectives.shm import ENV_SHARED_MEMORY, SharedReduceScatter  # noqa: E402
from spar_comm.costmodel import CPU, auto  # noqa: E402
from spar_comm.device import device_index  # noqa: E402
from spar_comm.torch.transport import TorchComm  # noqa: E402
from torchrun_helpers import report, say  # noqa: E402

STEPS = 3


def integer_grads(seed: int, step: int, p: int, n: int, dtype) -> list:
    """As test_collectives_mpi's: multiples of 2**-6 below 2**12, exact to sum in any order."""
    rng = np.random.default_rng([seed, step])
    return [(rng.integers(-(2**12), 2**12, n) * 2.0**-6).astype(dtype) for _ in range(p)]


def cases(node_of_several: bool):
    """(algorithm, n, density, values, indices, shared memory): each through
    the node's shared memory, and those with a node phase also through the
    group's collectives (``SPAR_COMM_SHM=0``) where a node has several ranks."""
    for algorithm in reproducible():
        for n, density in ((13, 0.2), (1037, 0.05)):
            yield algorithm, n, density, None, None, True
        if algorithm in CODECS["values"]:
            yield algorithm, 1037, 0.05, "int8", "auto" if algorithm in CODECS["indices"] else None, True
        if node_of_several and algorithm in NODE_PHASE:
            yield algorithm, 1037, 0.05, None, None, False


#: The algorithms whose node phase is a Reduce_scatter and an Allgather (``shm.node_collectives``).
NODE_PHASE = ("hier_dense", "hitopk", "adasum")



def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    args = parser.parse_args()
    if args.device == "gpu":
        import cupy
        import torch

        torch.cuda.set_device(device_index(int(os.environ["LOCAL_RANK"]), torch.cuda.device_count()))
        cupy.cuda.Device(torch.cuda.current_device()).use()
    to_device, to_host = (cupy.asarray, cupy.asnumpy) if args.device == "gpu" else (np.asarray, np.asarray)
    dist.init_process_group(args.backend)
    world = TorchComm.world()
    p, rank = world.size, world.rank
    count, failures, staged = 0, [], set()
    given = os.environ.get(ENV_SHARED_MEMORY)
    for rpn in layouts(p):
        topology = Topology(world, ranks_per_node=rpn, device=args.device)
        assert topology.local_shares_memory
        for algorithm, n, density, values, indices, shared in cases(max(topology.node_sizes) > 1):
            count += 1
            os.environ[ENV_SHARED_MEMORY] = "1" if shared else "0"
            reducer = make_allreducer(algorithm, topology, n, "float32", density=density, selector="exact",
                                      values=values, indices=indices)
            if algorithm in NODE_PHASE and args.device == "cpu":
                by_memory = isinstance(reducer.reduce_scatter, SharedReduceScatter)
                if by_memory != (shared and topology.local_size > 1):
                    failures.append(f"{algorithm} rpn={rpn} shared={shared}: node phase {reducer.reduce_scatter}")
            ref = Reference(algorithm, p, rpn, n, "float32", density, values=values)
            for step in range(STEPS):
                grads = integer_grads(n, step, p, n, np.float32)
                out = to_host(reducer.allreduce(to_device(grads[rank])))
                staged.add(reducer.last["bytes_staged"] > 0)
                expected = ref.step(grads)
                digests = world.allgather(hashlib.sha256(out.tobytes()).hexdigest())
                problem = ("output differs from the reference" if not np.array_equal(out, expected) else
                           "residual differs" if not np.array_equal(to_host(reducer.residual_full()),
                                                                      ref.residuals[rank])
                           else "ranks differ" if len(set(digests)) > 1 else None)
                if problem:
                    failures.append(f"{algorithm} n={n} values={values} rpn={rpn} step {step}: {problem}")
                    break
            reducer.free()
        if given is None:
            os.environ.pop(ENV_SHARED_MEMORY)
        else:
            os.environ[ENV_SHARED_MEMORY] = given
        if topology.num_nodes > 1 and args.device == "cpu":  # auto times the link as this transport moves messages
            count += 1
            pricing = auto.price(topology)
            beta = pricing.machine.beta_inter
            seen = world.allgather(repr((pricing.transport, pricing.machine.to_dict())))
            if pricing.transport != "torch" or len(set(seen)) > 1 or not 0 < beta < float("inf") or beta == CPU.beta_inter:
                failures.append(f"auto over rpn={rpn}: priced {seen[rank]}, not a link timed over the group alike")
            elif "between nodes over torch.distributed" not in pricing.describe():
                failures.append(f"auto over rpn={rpn}: {pricing.describe()!r} names no transport")
        topology.free()
    if args.device == "gpu":
        say(f"rank {rank}: staging: in place {topology.memory.cuda_aware}, staged {sorted(staged)}")
    report(f"{count} cases, {len(failures)} failed", failures)


if __name__ == "__main__":
    main()
