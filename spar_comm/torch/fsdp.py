"""FSDP2 sharded inside each node, its shards reduced between nodes by
spar_comm: HSDP with a sparse replica reduction.

    mesh = sct.node_mesh()                                # ("rep", "shard"): a row a node
    for block in model.blocks:
        fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    state = sct.hsdp_hook(model, "topka", density=0.01, mesh=mesh)

FSDP reduce-scatters each parameter group's gradient inside the node and
hands the hook the flat output: the node's mean of this rank's shard
(padding included). The hook reduces it in place over the **replica
group**, the ranks that hold the same shard on every node, one a node, so
that FSDP adds the mean over all ranks into ``.grad``, as torch's own HSDP
(a 2-D mesh) gives it. That is HiTopKComm's shape: FSDP's reduce-scatter is
its first phase, the exchange between nodes its second, and FSDP's
all-gather of parameters before the next forward its last. Error feedback
keeps a residual of the shard only.

The hook runs where FSDP calls it, on backward's thread: FSDP reads its
result as soon as it returns. Each FSDP module's group gets its own
allreducer from the bucket engine (``engine.py``), built on its first call,
so ``auto`` chooses per group. The replica group is a sub-group of the job,
the one spar_comm reduces over: ``hsdp_hook`` agrees it from the mesh on
every rank at start-up, and a job whose groups do not form such a mesh is
refused on every rank (``replica_groups``).
"""
from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from .. import waiting
from ..collectives import AUTO, Allreducer
from ..consensus import raise_if_any, require_same
from ..errors import ConfigError, SparCommError
from ..topology import Topology, ranks_per_node_setting
from .backward_end import EndOfBackward, after_queued
from .engine import Engine, EngineOwner, Reduction, reduction_of
from .state import HSDP_STATE_FORMAT, HSDPResidual, hsdp_residuals, rank_key
from .transport import backends, node_name
from .world import job_comm, require_job_world

#: The algorithms of a flat shard between nodes, one rank a node.
USABLE = ("dense", "topka", "gtopk")
#: Those that are another one there: with one rank a node, the node's phases do nothing.
SAME_AS = {"hitopk": "topka", "hier_dense": "dense"}
#: Those that do not apply, and why.
NOT_HERE = {
    "hitopk_leader": "it gathers each node's selections at the node's first rank, and the replica group has one "
                     "rank a node: nothing is gathered, and what remains is topka",
    "adasum": "its result is not the mean over the ranks, which HSDP's is",
    "powersgd": "it factors each parameter's matrix, and a shard is rows of several parameters end to end, padded",
}

#: (this rank's FSDP shard group, its replica group from the user's mesh or None), as every rank tells it.
Told = Tuple[Tuple[int, ...], Optional[Tuple[int, ...]]]


def replica_groups(everyone: Sequence[Told]) -> Tuple[List[Tuple[int, ...]], Optional[str]]:
    """The replica groups of a job, by their first rank, from what each rank
    ``r`` told (``everyone[r]``): the ranks of its FSDP mesh in FSDP's order
    (the shard index is the position), and its replica group where the user
    gave a mesh. Or why they are no HSDP mesh: the FSDP meshes must split
    the job into nodes of one size, and each replica group must hold the
    ranks of one shard index, one on every node. Pure: every rank computes
    the same answer from the same gathered list."""
    world = len(everyone)
    for r, (shard, _) in enumerate(everyone):
        if r not in shard:
            return [], f"rank {r}'s FSDP mesh {list(shard)} does not hold rank {r}"
    nodes = sorted({tuple(shard) for shard, _ in everyone})
    if sorted(r for node in nodes for r in node) != list(range(world)):
        return [], f"the ranks' FSDP meshes are no partition of the job's {world} ranks into nodes: {nodes}"
    sizes = sorted({len(node) for node in nodes})
    if len(sizes) > 1:
        return [], (f"the nodes' FSDP meshes hold {sizes} ranks: every node must shard the model into as many "
                    f"shards, {nodes}")
    index = {r: node.index(r) for node in nodes for r in node}
    groups = [tuple(r for r in range(world) if index[r] == i) for i in range(sizes[0])]
    given = [r for r, (_, replicas) in enumerate(everyone) if replicas is not None]
    if given and len(given) < world:
        return [], f"ranks {given} gave a mesh to hsdp_hook and the others none"
    for r in given:
        mine = groups[index[r]]
        if tuple(sorted(everyone[r][1])) != mine:
            return [], (f"rank {r}'s replica group in the mesh is {list(everyone[r][1])}, but the ranks that hold its "
                        f"shard on every node are {list(mine)} (FSDP's meshes: {nodes})")
    return groups, None


def node_mesh(ranks_per_node: Optional[int] = None, device_type: str = "cpu") -> Any:
    """A 2-D device mesh of the job's nodes, for ``fully_shard(mesh=mesh["shard"])``.

    Args:
        ranks_per_node: emulated nodes of this many consecutive ranks; default
            ``SPAR_COMM_RANKS_PER_NODE``, else the nodes as torchrun's
            ``GROUP_RANK`` (or the host's name) tells them.
        device_type: the mesh's, as ``init_device_mesh`` takes it.

    Returns:
        A ``DeviceMesh`` with dimensions ``("rep", "shard")``: a row a node.

    Raises:
        ConfigError: on every rank, where the nodes differ in size (an HSDP
            replica is a whole node).

    Example:
        >>> mesh = sct.node_mesh()
        >>> fully_shard(model, mesh=mesh["shard"])

    Collective over torch.distributed's default group.
    """
    from torch.distributed.device_mesh import DeviceMesh

    emulated, problem = ranks_per_node_setting(ranks_per_node)
    if problem is not None:  # the same setting and the same message on every rank
        raise ConfigError(problem)
    names = [None] * dist.get_world_size()
    dist.all_gather_object(names, dist.get_rank() // emulated if emulated else node_name())
    nodes = [[r for r, name in enumerate(names) if name == each] for each in dict.fromkeys(names)]
    if len({len(node) for node in nodes}) > 1:
        raise ConfigError(f"the job's nodes hold {[len(node) for node in nodes]} ranks: HSDP needs nodes of one size")
    return DeviceMesh(device_type, torch.tensor(nodes), mesh_dim_names=("rep", "shard"))


class _Shard:
    """An FSDP module's parameter group: its allreducer, and the node means
    of the micro-steps not yet exchanged."""

    def __init__(self, reducer: Allreducer):
        self.reducer = reducer
        self.carry: Optional[torch.Tensor] = None


class HSDPState(EngineOwner):
    """The hook's state: an allreducer per FSDP module over the replica
    group, and the residuals. ``state_dict()`` / ``load_state_dict()``
    between steps; ``density`` settable between steps, alike on every rank.

    Gradient accumulation: ``set_requires_gradient_sync(False)`` on the
    micro-steps skips both reductions (FSDP calls no hook).
    ``set_requires_all_reduce(False)`` reduce-scatters each micro-step and
    keeps the node's mean here; the step with it True again exchanges the
    sum of them all between nodes, as torch's HSDP does."""

    def __init__(self, reduction: Reduction, topology: Topology, node: Any, comm: Any, groups: Dict[str, Any],
                 grad_scaler: Any, divide: Tuple[Optional[float], bool], mesh: Tuple[int, int], shard: int):
        self.reduction, self.topology = reduction, topology
        self.mesh = mesh  # (replicas, ranks a node)
        self.shard = shard  # this rank's place in its node's FSDP mesh: the shard it holds of every module
        self._node, self._comm = node, comm  # the node's ranks (FSDP's shard group), and the job's
        self._groups = groups  # FSDP module's name -> its parameter group
        self._divide = divide  # (divide factor, force-sum) as hsdp_hook found them
        self._engine = Engine(reduction, topology.world, grad_scaler, among=USABLE)
        self.shards: Dict[str, _Shard] = {}
        self._loaded: Dict[str, HSDPResidual] = {}
        self._step_open = False
        self._backward_end = EndOfBackward(lambda: after_queued(self._step_ended))

    # -- the hook (backward's thread) ------------------------------------------------------
    def hook(self, name: str, output: torch.Tensor) -> None:
        """FSDP's call for module ``name``: ``output``, the node's mean of this
        rank's shard, becomes the mean over all ranks, in place. An error of
        every rank leaves it NaN and comes out of ``backward()`` at its end,
        once FSDP is done; one of this rank's alone ends the job."""
        in_backward = self._backward_end.arm()
        if not self._step_open:
            self._step_open = True
            self._engine.begin_step([shard.reducer for shard in self.shards.values()])
        with self._engine.job(f"spar_comm.torch HSDP hook, {name or 'the root module'}"):
            try:
                self._exchange(name, output)
            except SparCommError:  # raised on every rank alike
                output.fill_(float("nan"))
                raise
        if not in_backward:
            self._step_ended()

    def _exchange(self, name: str, output: torch.Tensor) -> None:
        group = self._groups[name]
        divide = (group.gradient_divide_factor, group.force_sum_reduction_for_comms)
        if divide != self._divide:
            raise ConfigError(f"FSDP module {name!r}'s divide factor and force-sum are {divide}, not {self._divide} "
                              "as hsdp_hook found them: set them before calling it")
        shard = self._shard(name, output)
        if not group.all_reduce_grads:  # a micro-step: keep the node's mean for the exchange
            shard.carry = output.clone() if shard.carry is None else shard.carry.add_(output)
            output.zero_()  # FSDP adds it into .grad
            return
        if shard.carry is not None:
            output.add_(shard.carry)
            shard.carry = None  # taken, or NaN with the step, which is skipped whole
        self._engine.reduce(shard.reducer, output, finite=self._node_finite(output))

    def _shard(self, name: str, output: torch.Tensor) -> _Shard:
        """The module's allreducer, built on its first call (collective over
        the replica group), with the residual loaded for it."""
        shard = self.shards.get(name)
        if shard is None:
            if not self.shards:
                self._engine.price(self.topology)
            reducer = self._engine.make(self.topology, output.numel(), str(output.dtype).replace("torch.", ""))
            shard = self.shards[name] = _Shard(reducer)
        loaded = self._loaded.pop(name, None)
        if loaded is not None and shard.reducer.keeps_residual:
            _, span, values = loaded
            shard.reducer.load_residual_state(span, values * self._engine.scale)
        return shard

    def _node_finite(self, output: torch.Tensor) -> Optional[bool]:
        """Whether every rank of the node holds a finite shard (None on nodes of
        one rank: the allreducer checks): a NaN in one shard then makes the
        group NaN on every rank of the job, not on its shard's ranks alone."""
        if self._node.size == 1:
            return None
        verdict = np.array([int(bool(torch.isfinite(output).all()))], dtype=np.int64)
        waiting.collective(self._node, "Allreduce", MPI.IN_PLACE, verdict, op=MPI.MIN)
        return bool(verdict[0])

    def _step_ended(self) -> None:
        """As backward ends, FSDP done: put back the residuals of a step that
        overflowed (it is skipped), and raise what a reduction raised on every rank."""
        self._step_open = False
        errors = self._engine.end_step()
        if errors:
            raise errors[0]

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's residuals under ``["residuals"]["rank{r}"]``, a tuple of
        ``(module, shard, lo, hi, values)`` (its span of the module's flat
        shard, in the gradients' own units), beside the mesh, the algorithm and the
        density. Local; call it between steps.

        Raises:
            ConfigError: between micro-steps, with node means not yet exchanged."""
        if any(shard.carry is not None for shard in self.shards.values()):
            raise ConfigError("the HSDP state holds micro-steps' node means not yet exchanged: save after the step")
        mine = {name: (span, values.copy()) for name, (_, span, values) in self._loaded.items()}
        for name, shard in self.shards.items():
            if shard.reducer.keeps_residual:
                span, values = shard.reducer.residual_state()
                mine[name] = (span, values / self._engine.scale)
        entries = tuple((name, self.shard, int(lo), int(hi), torch.from_numpy(np.ascontiguousarray(values)))
                        for name, ((lo, hi), values) in sorted(mine.items()))
        return {"format": HSDP_STATE_FORMAT, "world_size": self._comm.size, "mesh": list(self.mesh),
                "algorithm": self.algorithm, "settings": self.reduction.to_dict(), "density": self.density,
                "residuals": {rank_key(self._comm.rank): entries}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Take this rank's residuals and the density from what its
        ``state_dict()`` returned on the same mesh; each module's allreducer
        takes its residual on its next call. Collective over the job.

        Raises:
            ConfigError: on every rank, before anything is loaded, where any
                rank's state does not fit (another mesh, another rank's)."""
        mine, problem = hsdp_residuals(state, self._comm.rank, self._comm.size, self.mesh)
        strange = sorted(name for name, (shard, _, _) in mine.items() if name not in self._groups or shard != self.shard)
        if problem is None and strange:
            problem = (f"the HSDP state's residuals of modules {strange} are of no shard this rank holds (shard "
                       f"{self.shard} of modules {sorted(self._groups)})")
        raise_if_any(self._comm, problem)
        for shard in self.shards.values():  # rebuilt on their next calls, taking the loaded residuals
            shard.reducer.free()
        self.shards, self._loaded = {}, mine
        self.density = float(state.get("density", self.density))


def hsdp_hook(model: torch.nn.Module, algorithm: str = "topka", density: float = 0.001, *, mesh: Any = None,
              selector: str = "mstopk", error_feedback: bool = True, non_finite: str = "propagate",
              grad_scaler: Any = None, transport: Optional[str] = None, values: Optional[str] = None,
              indices: Optional[str] = None, **options: Any) -> HSDPState:
    """Reduce an FSDP2 model's shards between nodes with spar_comm: HSDP.

    Call it after ``fully_shard`` on every module, each on the node's mesh
    (one dimension, the ranks of a node), before the first backward. It sets
    the all-reduce hook of every FSDP module, the root included.

    Args:
        model: the root module that ``fully_shard`` made.
        algorithm: ``dense``, ``topka``, ``gtopk`` or ``auto`` (which picks
            one of them per FSDP module). ``hitopk`` is ``topka`` here and
            ``hier_dense`` is ``dense``: the replica group has one rank a
            node. ``hitopk_leader``, ``adasum`` and ``powersgd`` do not apply.
        density, selector, values, indices, error_feedback: as for
            ``spar_comm.make_allreducer``, one allreducer per FSDP module,
            error feedback on its shard; ``options`` too (``max_density``).
        mesh: the 2-D mesh the model was sharded on one dimension of (as
            ``node_mesh`` makes it); its other dimension must be the replica
            groups. Default: the replica groups from FSDP's own meshes (the
            ranks at one place in every node's).
        non_finite, grad_scaler: as for ``comm_hook``: a NaN or Inf on any
            rank gives the group NaN on every rank, residuals as they were.
        transport: as for ``comm_hook``: the job's torch.distributed group,
            or MPI's world under ``mpiexec`` with ``transport="mpi"``.

    Returns:
        The ``HSDPState`` (``state_dict()``, ``load_state_dict()``, ``density``).

    Raises:
        ConfigError: on every rank, for bad settings, a model not sharded by
            ``fully_shard`` on a 1-D mesh, groups that are no HSDP mesh, or a
            divide factor FSDP reduces with ``PREMUL_SUM`` on gloo.

    Example:
        >>> state = hsdp_hook(model, "topka", density=0.01, mesh=mesh)

    Collective over the job.
    """
    comm = job_comm(None, transport)
    require_job_world(comm, "spar_comm.torch.hsdp_hook")
    groups, shard_mesh, problem = _fsdp_groups(model)
    told: Told = ((), None)
    if problem is None:
        told, problem = _told(shard_mesh, mesh)
    raise_if_any(comm, problem)
    replicas, problem = replica_groups(comm.allgather(told))
    if problem is not None:  # from the same gathered list on every rank
        raise ConfigError(f"spar_comm.torch.hsdp_hook: {problem}")
    node_size = len(told[0])
    divide, problem = _divide_rule(groups, node_size, shard_mesh)
    name = SAME_AS.get(algorithm, algorithm)
    problem = problem or _algorithm_problem(name)
    reduction = reduction_of(name, non_finite, options, density=density, selector=selector,
                             error_feedback=error_feedback, values=values, indices=indices,
                             average=divide[0] is None)
    raise_if_any(comm, problem or reduction.problem())
    require_same(comm, "hsdp_hook settings", {**reduction.agreed(), "divide": divide})
    mine = next(i for i, group in enumerate(replicas) if comm.rank in group)
    replica = comm.Split(mine, comm.rank)
    node = comm.Split(min(told[0]), comm.rank)
    device = "gpu" if any(p.is_cuda for p in model.parameters()) else "cpu"
    topology = Topology(replica, ranks_per_node=1, device=device)
    state = HSDPState(reduction, topology, node, comm, groups, grad_scaler, divide, (len(replicas), node_size),
                      told[0].index(comm.rank))
    for module_name, module in _fsdp_modules(model):
        module.set_all_reduce_hook(functools.partial(state.hook, module_name))
    return state


def _fsdp_modules(model: torch.nn.Module) -> List[Tuple[str, Any]]:
    from torch.distributed.fsdp import FSDPModule

    return [(name, module) for name, module in model.named_modules() if isinstance(module, FSDPModule)]


def _fsdp_groups(model: torch.nn.Module) -> Tuple[Dict[str, Any], Any, Optional[str]]:
    """The parameter group of each FSDP module that has one, by name, and
    the one mesh they shard on; or why the model is not one for the hook."""
    modules = _fsdp_modules(model)
    if not modules or modules[0][0] != "":
        return {}, None, "the model is not sharded by fully_shard (call it on the model, the root, too)"
    groups: Dict[str, Any] = {}
    for name, module in modules:
        found = module._get_fsdp_state()._fsdp_param_groups
        if len(found) > 1:
            return {}, None, f"FSDP module {name!r} has {len(found)} parameter groups; the hook takes one a module"
        if found:
            groups[name] = found[0]
    # By their ranks: ``mesh["shard"]`` makes a new DeviceMesh at every call.
    meshes = {(tuple(group.mesh_info.mesh.mesh.shape), tuple(group.mesh_info.mesh.mesh.flatten().tolist()),
               group.mesh_info.mesh.mesh_dim_names): group.mesh_info.mesh for group in groups.values()}
    if len(meshes) != 1:
        return {}, None, f"the FSDP modules shard on {len(meshes)} meshes; the hook needs one, the node's"
    (mesh,) = meshes.values()
    if mesh.ndim != 1:
        return {}, None, ("the model is sharded on a 2-D mesh: that is torch's own HSDP, which all-reduces between "
                          "nodes itself; shard on the node's dimension, fully_shard(mesh=mesh['shard'])")
    return groups, mesh, None


def _told(shard_mesh: Any, mesh: Any) -> Tuple[Told, Optional[str]]:
    """What this rank tells ``replica_groups``, or why the user's ``mesh`` cannot tell it."""
    shard = tuple(int(r) for r in shard_mesh.mesh.tolist())
    if mesh is None:
        return (shard, None), None
    names = list(mesh.mesh_dim_names or ())
    mine = (shard_mesh.mesh_dim_names or (None,))[0]
    if mesh.ndim != 2 or mine not in names:
        return (shard, None), (f"mesh must be 2-D with the dimension the model is sharded on ({mine!r}); it has "
                               f"dimensions {names}")
    other = names[1 - names.index(mine)]
    return (shard, tuple(int(r) for r in mesh[other].mesh.tolist())), None


def _divide_rule(groups: Dict[str, Any], node_size: int, shard_mesh: Any
                 ) -> Tuple[Tuple[Optional[float], bool], Optional[str]]:
    """(divide factor, force-sum), alike on every FSDP module, or why not.
    Without a factor the hook averages over the replicas (FSDP divides by
    the node's size, before or after it); with one it sums, FSDP dividing
    by the factor. A factor other than the node's size without force-sum
    makes FSDP's reduce-scatter ``PREMUL_SUM``, which gloo refuses."""
    found = {(group.gradient_divide_factor, bool(group.force_sum_reduction_for_comms)) for group in groups.values()}
    if len(found) > 1:
        return (None, False), (f"the FSDP modules have divide factors and force-sum {sorted(found, key=str)}: set "
                               "them alike on every module")
    factor, force_sum = found.pop()
    group = next(iter(groups.values()))
    policy = group.mp_policy
    reduce_dtype = policy.reduce_dtype or policy.param_dtype or group.fsdp_params[0].sharded_param.dtype
    premul = factor is not None and not force_sum and factor != node_size and \
        reduce_dtype in (torch.float32, torch.bfloat16)
    host, _ = backends(shard_mesh.get_group())
    if premul and host == "gloo":
        return (factor, force_sum), (f"a gradient divide factor of {factor} on nodes of {node_size} ranks makes FSDP "
                                     "reduce-scatter with PREMUL_SUM, which gloo refuses: also call "
                                     "set_force_sum_reduction_for_comms(True), or leave the factor unset")
    return (factor, force_sum), None


def _algorithm_problem(algorithm: str) -> Optional[str]:
    if algorithm in USABLE or algorithm == AUTO:
        return None
    if algorithm in NOT_HERE:
        return f"algorithm {algorithm!r} does not apply to HSDP's replica reduction: {NOT_HERE[algorithm]}"
    return f"algorithm {algorithm!r}: hsdp_hook takes {', '.join(USABLE)}, auto, or {', '.join(SAME_AS)}"
