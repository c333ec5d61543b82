"""Which ranks share a node, and the communicators the hierarchical algorithms use.

Nodes are found with ``Split_type(COMM_TYPE_SHARED)``, or emulated as blocks
of ``ranks_per_node`` consecutive ranks so that multi-node behaviour can be
tested on one host. Nodes may differ in size (3 ranks at 2 per node): the
hierarchical algorithms then cut the vector into ``G`` shards, ``G`` the size
of the largest node, and on a smaller node each rank owns a contiguous run of
shards. The ranks that own shard ``j`` on every node form ``rails[j]``; with
equal nodes that is exactly ``rail``, the ranks with my local rank.

A topology also fixes where the rank's arrays live (``memory``): host memory,
or under ``device="gpu"`` the GPU ``r % device_count``, r the rank's place
among the ranks of its host (not of its emulated node: emulated nodes on one
host with 8 GPUs use all 8).
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

from mpi4py import MPI

from . import waiting
from .consensus import raise_if_any, require_same
from .device import open_memory
from .memory import HostMemory
from .mpi_strings import processor_name

ENV_RANKS_PER_NODE = "SPAR_COMM_RANKS_PER_NODE"


def ranks_per_node_setting(given: Optional[int]) -> Tuple[Optional[int], Optional[str]]:
    """The emulated node size from the argument or the environment (None:
    nodes are real), or a problem."""
    source, value = "ranks_per_node", given
    if value is None:
        text = os.environ.get(ENV_RANKS_PER_NODE, "").strip()
        if not text:
            return None, None
        source, value = ENV_RANKS_PER_NODE, text
        try:
            value = int(text)
        except ValueError:
            return None, f"{source}={text!r} is not an integer"
    if isinstance(value, bool) or not isinstance(value, int):
        return None, f"{source} must be an integer, got {type(value).__name__}"
    if value < 1:
        return None, f"{source} must be >= 1, got {value}"
    return value, None


def shard_owner(shard: int, node_size: int, shards: int) -> int:
    """The local rank that owns ``shard`` of ``shards`` on a node of ``node_size``
    ranks: contiguous runs, every rank at least one shard when node_size <= shards."""
    return shard * node_size // shards


def shard_bounds(n: int, parts: int, j: int) -> Tuple[int, int]:
    """The balanced split: shard ``j`` of ``parts`` is ``[j*n//parts, (j+1)*n//parts)``."""
    return j * n // parts, (j + 1) * n // parts


class Topology:
    """The world split into nodes: ``local``, ``rail``, ``leader`` and shard rails.

    Every communicator is derived from a duplicate of ``comm``, so library
    traffic never matches messages of the calling program.
    """

    def __init__(self, comm: Optional[MPI.Comm] = None, ranks_per_node: Optional[int] = None, device: str = "cpu"):
        comm = MPI.COMM_WORLD if comm is None else comm
        emulated, problem = ranks_per_node_setting(ranks_per_node)
        raise_if_any(comm, problem or waiting.read_environment())
        # Patient: ranks arrive here after imports and data loading of their own.
        with waiting.watched("making the topology", comm, patient=True):
            self._split(comm, emulated, device)

    def _split(self, comm: MPI.Comm, emulated: Optional[int], device: str) -> None:
        """The communicators, named for the messages of a deadline (``waiting.describe``)."""
        require_same(comm, "topology", {"ranks_per_node": emulated, "device": device})

        self.world: MPI.Comm = comm.Dup()
        rank = self.world.rank
        if emulated is None:
            self.local: MPI.Comm = self.world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        else:
            self.local = self.world.Split(color=rank // emulated, key=rank)
        self.emulated_ranks_per_node = emulated
        host = self.local if emulated is None else self.world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
        #: "mpi", or "torch" for a torch.distributed group (``torch/transport.py``).
        self.transport: str = getattr(comm, "transport", "mpi")
        self.local_shares_memory: bool = (emulated is None and self.transport == "mpi") or self._local_within(host)
        self.local_rank: int = self.local.rank
        self.local_size: int = self.local.size
        #: Where the rank's arrays live; ``memory.index`` is its GPU.
        self.memory: HostMemory = open_memory(device, self.world, host.rank)
        if host is not self.local:
            host.Free()

        # Number nodes by their lowest world rank, the same order on every rank.
        first = self.local.allreduce(rank, op=MPI.MIN)
        nodes = self.world.allgather((first, self.local_size))
        firsts = sorted(set(nodes))
        self.node: int = firsts.index((first, self.local_size))
        self.num_nodes: int = len(firsts)
        self.node_sizes: List[int] = [size for _, size in firsts]
        self.hosts: List[str] = self.world.allgather(processor_name())

        self.rail: MPI.Comm = self.world.Split(color=self.local_rank, key=self.node)
        self.leader: MPI.Comm = self.world.Split(
            color=0 if self.local_rank == 0 else MPI.UNDEFINED, key=self.node
        )

        # Shards of the hierarchical algorithms (see the module docstring).
        self.shards_per_node: int = max(self.node_sizes)
        g, shards = self.local_size, self.shards_per_node
        self.my_shards: List[int] = [j for j in range(shards) if shard_owner(j, g, shards) == self.local_rank]
        if self.equal_nodes:
            self.rails: Dict[int, MPI.Comm] = {self.local_rank: self.rail}
        else:
            self.rails = {}
            for j in range(shards):  # collective over world, in the same order everywhere
                color = j if j in self.my_shards else MPI.UNDEFINED
                rail_j = self.world.Split(color=color, key=self.node)
                if rail_j != MPI.COMM_NULL:
                    self.rails[j] = rail_j
        self.world.Set_name("the world")
        self.local.Set_name("inside a node")
        self.rail.Set_name("between nodes")
        for j, rail_j in self.rails.items():
            if rail_j is not self.rail:
                rail_j.Set_name(f"between nodes (shard {j})")
        if self.leader != MPI.COMM_NULL:
            self.leader.Set_name("between nodes (their first ranks)")

    def _local_within(self, host: MPI.Comm) -> bool:
        """Whether every rank of my (emulated) node is on my ``host`` and can map
        my memory: as MPI places them, or, for a torch.distributed group, whose
        nodes are torchrun's groups, where they name one host."""
        if self.transport != "mpi":  # every rank of the node gathers the same names
            return len(set(self.local.allgather(processor_name()))) == 1
        placed = MPI.Group.Translate_ranks(self.local.group, list(range(self.local.size)), host.group)
        return bool(self.local.allreduce(int(MPI.UNDEFINED not in placed), op=MPI.MIN))

    @property
    def equal_nodes(self) -> bool:
        return len(set(self.node_sizes)) == 1

    def local_shard_counts(self, n: int) -> List[int]:
        """Elements each local rank owns after a Reduce_scatter of an n-vector."""
        g, shards = self.local_size, self.shards_per_node
        counts = [0] * g
        for j in range(shards):
            lo, hi = shard_bounds(n, shards, j)
            counts[shard_owner(j, g, shards)] += hi - lo
        return counts

    def owned_range(self, n: int) -> Tuple[int, int]:
        """The contiguous slice of an n-vector this rank owns in its node."""
        return shard_bounds(n, self.shards_per_node, self.my_shards[0])[0], shard_bounds(
            n, self.shards_per_node, self.my_shards[-1]
        )[1]

    def describe(self) -> str:
        sizes = self.node_sizes
        shape = f"{self.num_nodes} x {sizes[0]}" if self.equal_nodes else "+".join(map(str, sizes))
        how = (
            f"emulated, {self.emulated_ranks_per_node} ranks per node"
            if self.emulated_ranks_per_node
            else "nodes by shared memory"
        )
        return (
            f"{self.world.size} ranks as {shape} ({how}); "
            f"rank {self.world.rank} is local rank {self.local_rank} of node {self.node}; {self.memory.describe()}"
        )

    def free(self) -> None:
        """Release the communicators (optional: MPI_Finalize frees them too)."""
        comms = {id(c): c for c in [self.local, self.rail, self.leader, *self.rails.values()]}
        for c in comms.values():
            if c != MPI.COMM_NULL:
                c.Free()
        self.world.Free()
