"""FSDP2 across emulated nodes (HSDP) under ``mpiexec``, as a user's script
runs there: torch.distributed from the MPI launch (``init_process_group``),
the hook over MPI's world (``transport="mpi"``), its replica groups split
from it. The cases are tests/torchrun_fsdp.py's, which the torchrun
launches run over torch.distributed: the dense hook ends on torch's own HSDP,
``topka`` conserves per shard with the same shards on every replica. At 4
ranks only, 2 nodes of 2: FSDP on gloo is slow to start, and the layouts
are the torchrun launches' subject."""
from __future__ import annotations

import pytest
from mpi4py import MPI

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import spar_comm.torch as sct  # noqa: E402
from mpi_helpers import assert_all  # noqa: E402
from torchrun_fsdp import conserves, native_and_hook  # noqa: E402

COMM = MPI.COMM_WORLD
pytestmark = [pytest.mark.worlds(4), pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")]


@pytest.fixture(scope="module")
def mesh():
    """torch.distributed from the MPI launch, and its ("rep", "shard") mesh of the emulated nodes."""
    sct.init_process_group("gloo")
    yield sct.node_mesh()
    dist.destroy_process_group()


@pytest.mark.mpi(min_size=4)
def test_hsdp_over_mpi_is_torchs_hsdp_and_conserves(mesh):
    failures: list = []
    native_and_hook(mesh, failures, "dense over MPI", transport="mpi")
    conserves(mesh, failures, "topka", transport="mpi")
    everyone = COMM.allgather(failures)
    assert_all(COMM, not any(everyone), f"{tuple(mesh.mesh.shape)}: {everyone}")
