"""bench_peers.py's sharded modes: FSDP2 as a user runs it (over the whole
job, or torch's own HSDP on a mesh of the nodes), HSDP whose shards
spar_comm reduces between nodes (``sct.hsdp_hook``), and the floor of them
all, FSDP inside each node with nothing between nodes. They run in the
rank's own process, over torch.distributed's default group; every rank
evaluates, since a sharded model's forward is a collective.

Bytes between nodes, per rank and step, for torch's own: FSDP2 sends each
parameter group's padded shard to the other ranks of its mesh in every
all-gather (two a step, one for the root, whose parameters stay gathered
after its forward) and every reduce-scatter, ``(n - 1) x shard`` each, all
counted once the mesh spans nodes (as DDP's ring is); torch's HSDP adds a
ring all-reduce of the reduce-scatter's output over the replicas,
``2 (r - 1) / r x shard``. spar_comm's modes report what they sent."""
from __future__ import annotations

from typing import Any, Callable

import torch

from .. import torch as sct
from ..topology import Topology
from .peers import SHARDED, PeerSettings, Runner, Workload


def shard(model: torch.nn.Module, mesh: Any) -> None:
    """``fully_shard`` each block of ``model`` (its ``blocks``, else each child
    with parameters), then the root, as an FSDP2 script does."""
    from torch.distributed.fsdp import fully_shard

    units = list(getattr(model, "blocks", None) or
                 [child for child in model.children() if any(True for _ in child.parameters())])
    for module in [*units, model]:
        fully_shard(module, mesh=mesh)


def fsdp_bytes(model: torch.nn.Module, replicas: int, spans_nodes: bool) -> Callable[[], float]:
    """torch's own bytes a rank sends between nodes a step (the module's
    docstring), read from FSDP's parameter groups once they exist (after the
    first step): ``replicas`` is the replica dimension of torch's HSDP, 1
    without one; the shard mesh's own collectives count where it ``spans_nodes``."""
    def sent() -> float:
        total = 0.0
        for module in model.modules():
            state = getattr(module, "_get_fsdp_state", None)
            group = state()._fsdp_param_group if state else None
            if group is None:
                continue
            n = group.mesh_info.shard_mesh_size
            elements = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params)
            size = group.fsdp_params[0].sharded_param.element_size()
            gathers = 1 if group.post_forward_mesh_info is None else 2
            within = (gathers + 1) * (n - 1) * elements * size if spans_nodes else 0.0
            total += within + 2 * (replicas - 1) / replicas * elements * size
        return total
    return sent


def build_fsdp(mode: str, replica: torch.nn.Module, work: Workload, settings: PeerSettings,
               topology: Topology) -> Runner:
    """The runner of sharded ``mode`` on ``topology``'s nodes over
    torch.distributed's default group, its optimizer made after sharding, as
    FSDP2 needs (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    on, spar = SHARDED[mode]
    mesh = sct.node_mesh(topology.emulated_ranks_per_node)  # ("rep", "shard"): a row a node
    if on == "world":
        shard(replica, init_device_mesh("cpu", (mesh.mesh.numel(),)))
    else:
        shard(replica, mesh if on == "nodes" else mesh["shard"])
    optimizer = work.new_optimizer(replica.parameters())
    if spar is None:
        sent = fsdp_bytes(replica, mesh.size(0) if on == "nodes" else 1, on == "world" and mesh.size(0) > 1)
        return Runner(replica, optimizer, sent, collective=True)
    algorithm, values = spar
    state = sct.hsdp_hook(replica, algorithm, settings.density, mesh=mesh, selector=settings.selector,
                          values=values)

    def note() -> str:
        kept = sum(s.reducer.residual_state(copy=False)[1].size for s in state.shards.values())
        shard_elements = sum(s.reducer.size for s in state.shards.values())
        return f"residual {kept:,} elements a rank, its shard {shard_elements:,}"

    return Runner(replica, optimizer, lambda: float(sum(s.reducer.last["bytes_inter"] for s in state.shards.values())),
                  note, collective=True)
