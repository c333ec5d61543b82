"""spar_comm.torch's pieces that need no MPI job: where parameters must be for
a topology's memory, the stream layer chosen for it, and the torch job's world
checked against MPI's (this process's MPI world has one rank)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import spar_comm.torch as sct  # noqa: E402
from spar_comm import ConfigError  # noqa: E402
from spar_comm.memory import HOST  # noqa: E402
from spar_comm.torch.buckets import device_problem  # noqa: E402
from spar_comm.torch.engine import InOrder  # noqa: E402
from spar_comm.torch.streams import NoStreams, streams_for, tensor_device  # noqa: E402
from spar_comm.torch.fsdp import replica_groups  # noqa: E402
from spar_comm.torch.world import rank_problem  # noqa: E402

GPU0 = SimpleNamespace(name="gpu", index=0)
SIMULATED = SimpleNamespace(name="gpu-simulator", index=0)


def on(device: str):
    """A stand-in parameter on ``device`` (no GPU is needed to name one)."""
    return SimpleNamespace(device=torch.device(device))


def test_parameters_must_be_on_the_ranks_gpu():
    assert device_problem([("w", on("cuda:0"))], GPU0) is None
    assert "is on cuda:1, but this rank's GPU is cuda:0" in device_problem([("w", on("cuda:1"))], GPU0)
    assert "takes parameters on cuda:0" in device_problem([("w", on("cpu"))], GPU0)


def test_cpu_and_simulated_gpu_take_cpu_parameters():
    assert device_problem([("w", on("cpu"))], HOST) is None
    assert device_problem([("w", on("cpu"))], SIMULATED) is None
    assert "need Topology(device='gpu')" in device_problem([("w", on("cuda:0"))], HOST)
    assert "gpu-simulator takes CPU tensors" in device_problem([("w", on("cuda:0"))], SIMULATED)


def test_only_a_real_gpu_has_streams():
    for memory in (HOST, SIMULATED):
        streams = streams_for(memory)
        assert type(streams) is NoStreams and tensor_device(memory) == torch.device("cpu")
        assert streams.produced() is None and streams.finished() is None
        with streams.communicating([None]):
            pass
    assert tensor_device(GPU0) == torch.device("cuda", 0)


def test_a_launchers_world_size_that_is_not_mpis_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "1")
    both = r"MPI's world of 1 rank, but this torch job has 3 \(WORLD_SIZE=3, as torchrun sets it\)"
    for call in (sct.rank, sct.size, sct.init_process_group):
        with pytest.raises(ConfigError, match=both):
            call()
    assert not torch.distributed.is_initialized()


def test_a_launchers_world_size_that_is_mpis_is_taken(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("RANK", "0")
    assert (sct.rank(), sct.size()) == (0, 1)


def test_a_world_size_that_is_no_number_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "four")
    with pytest.raises(ConfigError, match=r"WORLD_SIZE='four' \(RANK=''\), not an integer"):
        sct.size()


@pytest.mark.parametrize("ranks, fine", [([None, None], True), ([0, 1], True), ([2, 0, 1], True),
                                         ([0, 0], False), ([0, None], False), ([1, 2], False)])
def test_mpis_ranks_must_be_the_torch_ranks_once_each(ranks, fine):
    problem = rank_problem(ranks)
    assert (problem is None) == fine, problem
    if not fine:
        assert problem.startswith("MPI's world and the torch job hold different processes (MPI rank 0 is torch rank")


@pytest.mark.parametrize("name, host, device, in_place", [
    ("gloo", "gloo", "gloo", False), ("nccl", None, "nccl", True), ("cpu:gloo,cuda:nccl", "gloo", "nccl", True),
    ("cuda:nccl", None, "nccl", True),
])
def test_a_groups_backends_say_where_its_buffers_go(monkeypatch, name, host, device, in_place):
    """gloo takes host tensors (and stays staged by spar_comm on the GPU); NCCL
    takes device tensors alone, so host buffers cross to the device."""
    from spar_comm.torch import transport

    monkeypatch.setattr(transport.dist, "get_backend", lambda group: name)
    assert transport.backends(object()) == (host, device)
    comm = transport.TorchComm.__new__(transport.TorchComm)
    comm._host_backend, comm._device_backend = host, device
    assert comm.cuda_aware is in_place


@pytest.mark.parametrize("op, expected", [("BOR", [0b0111, 0b1001]), ("BAND", [0b0000, 0b0001])])
def test_bitwise_reductions_fold_every_ranks_row(op, expected):
    """NCCL has no bitwise reductions: the flags are gathered, one row a rank, and folded."""
    import torch
    from mpi4py import MPI

    from spar_comm.torch.transport import fold_bitwise

    rows = torch.tensor([[0b0001, 0b0001], [0b0010, 0b1001], [0b0100, 0b0001]], dtype=torch.uint8)
    assert fold_bitwise(rows, getattr(MPI, op)).tolist() == expected


def test_the_torch_transport_refuses_a_buffer_it_could_only_copy():
    """A strided view would become a copy, and what the call wrote would be lost."""
    import numpy as np

    from spar_comm.torch.transport import _tensor

    from mpi4py import MPI

    columns = np.zeros((4, 6), dtype=np.float32)[:, :3]  # flattened, a copy
    for strided in (np.zeros(10, dtype=np.float32)[::2], columns, [columns, 8, MPI.BYTE]):
        with pytest.raises(ValueError, match="transport takes contiguous buffers only"):
            _tensor(strided)
    assert _tensor(np.zeros(10, dtype=np.float32)[2:]).numel() == 8
    whole = np.arange(10, dtype=np.float32)
    assert _tensor([whole, 8, MPI.BYTE]).data_ptr() == whole.ctypes.data  # the same memory, its first 8 bytes
    assert _tensor([whole, 8, MPI.BYTE]).numel() == 8


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 8), min_size=1, max_size=4), st.randoms())
def test_in_order_releases_each_round_in_index_order_whatever_the_arrival(rounds, rng):
    """Rounds of buckets arriving shuffled (the last index anywhere in its
    round) come out 0, 1, ..., n-1 per round, each item once: the order every
    rank's collectives follow."""
    order, released = InOrder(), []
    for n in rounds:
        arrivals = list(range(n))
        rng.shuffle(arrivals)
        for index in arrivals:
            released += order.arrived(index, (len(released), index), last=index == n - 1)
        assert order.next == 0
    assert [index for _, index in released] == [i for n in rounds for i in range(n)]


def nodes_of(*nodes):
    """What each rank tells ``replica_groups`` when the nodes are ``nodes`` (FSDP's order) and no mesh is given."""
    told = {r: (tuple(node), None) for node in nodes for r in node}
    return [told[r] for r in sorted(told)]


@pytest.mark.parametrize("nodes, groups", [
    (((0, 1), (2, 3)), [(0, 2), (1, 3)]),
    (((0, 1, 2), (3, 4, 5)), [(0, 3), (1, 4), (2, 5)]),
    (((0, 2), (1, 3)), [(0, 1), (2, 3)]),      # nodes that are not blocks of consecutive ranks
    (((1, 0), (2, 3)), [(1, 2), (0, 3)]),      # the shard index is the place in FSDP's mesh
    (((0, 1, 2, 3),), [(0,), (1,), (2,), (3,)]),  # one node: replica groups of one rank
])
def test_the_replica_groups_are_the_ranks_at_one_place_in_every_node(nodes, groups):
    assert replica_groups(nodes_of(*nodes)) == (groups, None)


def test_a_users_mesh_must_name_the_same_replica_groups():
    told = nodes_of((0, 1), (2, 3))
    assert replica_groups([(shard, (0, 2) if r % 2 == 0 else (1, 3)) for r, (shard, _) in enumerate(told)]) \
        == ([(0, 2), (1, 3)], None)
    crossed = [(shard, shard) for shard, _ in told]  # the mesh's "rep" dimension is the node
    assert "rank 0's replica group in the mesh is [0, 1], but the ranks that hold its shard on every node are " \
           "[0, 2]" in replica_groups(crossed)[1]


@pytest.mark.parametrize("told, expected", [
    (nodes_of((0, 1), (2,)), "the nodes' FSDP meshes hold [1, 2] ranks"),
    ([((0, 1), None), ((1, 2), None), ((1, 2), None)], "no partition of the job's 3 ranks"),
    ([((0, 1), None), ((0, 1), None), ((0, 1), None)], "rank 2's FSDP mesh [0, 1] does not hold rank 2"),
    ([((0, 1), (0, 2)), ((0, 1), None), ((2, 3), None), ((2, 3), None)], "ranks [0] gave a mesh"),
])
def test_groups_that_are_no_hsdp_mesh_are_refused(told, expected):
    groups, problem = replica_groups(told)
    assert groups == [] and expected in problem, problem
