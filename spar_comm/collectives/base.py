"""What every allreducer shares: its settings agreed across ranks, the pieces
it is built from, the call itself, and the ``.last`` figures.

An allreducer is a communication pattern (its own module) put together from
pieces with one job each: a compressor (``topk.py``: a selector and its k;
or a low-rank factorisation), a value codec and an index codec
(``codecs.py``: how the payload looks on the wire; ``sums.py``: a dense sum
through one), error feedback (``feedback.py``: what was not sent, or sent
inexactly) and channels (``channel.py``: MPI calls that keep the books).
What it refuses is in ``checks.py``.

A subclass implements ``_reduce(grad, call) -> flat array`` (the sum over ranks,
divided by their number through ``averaged`` when averaging), taking its
result array from ``output(call, ...)`` once it has read ``grad`` for the last time (the
caller may pass ``out=grad``), and says where its residual lives
(``feedback.cover``); the rest is here. Arrays are made through ``self.xp``,
the namespace of the memory the topology put the rank in (NumPy, or CuPy on
a GPU; see ``memory.py``), so one implementation of each algorithm serves both.

Subclasses work in ``self.dtype``, the dtype of sums, residuals and messages.
A float16 or bfloat16 gradient (``grad_dtype``) is widened to float32 on the
way in and its result rounded back once on the way out.
"""
from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import numpy as np
from mpi4py import MPI

from .. import waiting
from ..consensus import raise_if_any, require_same
from ..errors import ConfigError
from ..kernels import passes
from ..launch import abort_job
from ..topology import Topology
from .channel import Channel
from .checks import BAD_DENSITY, BAD_OUT, BAD_RESIDUAL, density_fits, problems_of, refusal, settings_problem
from .codecs import make_codec, make_index_codec
from .feedback import ErrorFeedback, Residual
from .pairs import PairExchange, PairLayout
from .settings import Call, Settings
from .shm import MessageAllgather, MessageReduceScatter, node_collectives
from .topk import TopK


#: Positions of an array, per element, past which one pass over all of it is
#: faster than indexing them (NumPy's fancy indexing costs about 20 passes' time
#: per position).
WHOLE_PASS_BEYOND = 1 / 32
#: The settings whose kernels this process has compiled (``Allreducer._kernels``).
_COMPILED: set = set()


def sum_dtype(dtype: Any) -> np.dtype:
    """The dtype a gradient of ``dtype`` is summed, kept and sent in: float32 for
    the 16-bit floats (whose own partial sums would round at every add, and
    which MPI has no type for), the dtype itself otherwise."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 else dtype


class Allreducer:
    """Sum (or average) a flat gradient over all ranks; see ``make_allreducer``."""

    #: The registered name of the algorithm.
    name = ""
    #: Whether the algorithm selects (and therefore keeps residuals).
    sparse = False
    #: Whether the result is the sum (or mean) over ranks; ``adasum``'s is not,
    #: so ``auto`` never swaps it in for another.
    sums = True
    #: Whether its result rounds by the order in which MPI sums (``powersgd``:
    #: products of sums), so that a serial model matches it to rounding only.
    approximates = False
    #: Settings of this algorithm alone (``make_allreducer(..., **options)``), with their defaults.
    options: Dict[str, Any] = {}

    def __init__(self, topology: Topology, size: int, dtype: Any = "float32", settings: Settings = Settings()):
        world = topology.world
        settings = settings.replace(max_density=settings.most_density,
                                    options={**type(self).options, **dict(settings.options)})
        raise_if_any(world, settings_problem(type(self), size, dtype, settings, topology.memory))
        require_same(world, "allreducer settings",
                     {"algorithm": self.name, "size": int(size), "dtype": np.dtype(dtype).name, **settings.agreed()})
        self.settings = settings
        self.options = dict(settings.options)  # the class's defaults, merged with those given
        self.topology = topology
        self.memory = topology.memory
        self.xp = self.memory.xp
        self.size = int(size)
        self.grad_dtype = np.dtype(dtype)
        self.dtype = sum_dtype(dtype)
        # A 16-bit gradient widened, then reduced in place (one array for every call).
        self._wide = None if self.dtype == self.grad_dtype else self.xp.empty(self.size, self.dtype)
        self.feedback = ErrorFeedback(self.error_feedback, self.xp, self.dtype)
        self.codec = make_codec(settings.values, self.dtype, self.xp)
        self._buffer: Any = None  # see ``buffer``
        self.reduce_scatter: Any = None  # the node's, for algorithms that make one (``node_collectives``)
        self.allgather: Any = None
        self._code = np.zeros(2, dtype=np.int64)  # this rank's problems (checks.PROBLEMS), its call's density's bits
        self._codes = np.zeros((world.size, 2), dtype=np.int64)
        self.last: Dict[str, float] = self._fresh_ledger()
        self.world = self.channel(world, spans_nodes=True)
        # What the first call compiles: its waits are patient, once per process.
        self._kernels = (self.name, settings.selector, self.dtype.str, self.grad_dtype.str, settings.values,
                         settings.indices, self.memory.kind)

    # -- the settings, as the pieces read them ---------------------------------------------
    @property
    def density(self) -> float:
        """A call's density unless it asks for another, up to ``max_density``."""
        return float(self.settings.density)

    @property
    def max_density(self) -> float:
        return float(self.settings.max_density)

    @property
    def error_feedback(self) -> bool:
        return bool(self.settings.error_feedback)

    # -- construction helpers for subclasses -------------------------------------------
    def channel(self, comm: MPI.Comm, spans_nodes: bool) -> Channel:
        """Wrap ``comm``; its bytes count as inter-node when it spans nodes."""
        inter = spans_nodes and self.topology.num_nodes > 1
        return Channel(comm, "inter" if inter else "intra", self.last, self.memory)

    def node_collectives(self) -> None:
        """Set up the node's phases: ``local`` (the node's channel), ``counts``
        (each local rank's share of the vector), ``reduce_scatter`` and
        ``allgather`` (see ``shm.node_collectives``: every Reduce_scatter is
        followed by an Allgather of ``allgather.region``, where this rank
        builds its part of the result); with ``shared_buffer`` the shared
        vector becomes ``buffer``."""
        self.local = self.channel(self.topology.local, spans_nodes=False)
        self.counts = self.topology.local_shard_counts(self.size)
        shares_memory = self.topology.local_shares_memory and self.memory.in_host_memory
        in_place = self.settings.shared_buffer and self._wide is None  # a 16-bit gradient is widened elsewhere
        self.reduce_scatter, self.allgather = node_collectives(self.local, self.counts, self.dtype, shares_memory,
                                                               in_place)
        self._buffer = self.reduce_scatter.buffer  # None: plain memory, made when asked for

    @classmethod
    def check_options(cls, size: int, options: Dict[str, Any]) -> Optional[str]:
        """A message for the first bad option of this algorithm, or None."""
        return None

    def top_k(self, span: int) -> TopK:
        """The compressor of one selection site, a span of ``span`` elements."""
        selector = self.memory.selector(self.settings.selector, dict(self.settings.selector_options))
        return TopK(selector, span, self.max_density, self.memory, self.last)

    def pair_exchange(self, channel: Channel, topk: TopK) -> PairExchange:
        """The exchange over ``channel`` of the pairs ``topk`` picks (a call's k a
        rank, positions within its span), through this allreducer's value and
        index codecs; what the value codec rounds away goes back to error feedback."""
        def layout_of(k: int) -> PairLayout:
            return PairLayout(k, self.dtype, self.xp, self.codec,
                              make_index_codec(self.settings.indices, k, topk.span, self.xp))

        return PairExchange(channel, topk.k_most, layout_of)

    def output(self, call: Call, zeroed: bool) -> Any:
        """The result array: the call's ``out`` or a new one, zero-filled when
        the algorithm writes only some positions."""
        out = call.out
        if zeroed:
            passes.book("zero-fill", 0, self.size)
        if out is None:
            return self.xp.zeros(self.size, self.dtype) if zeroed else self.xp.empty(self.size, self.dtype)
        if zeroed:
            out.fill(0)
        return out

    def averaged(self, values: Any) -> Any:
        """Divide by the world size in place when averaging. Each algorithm calls
        it where the fewest values are in hand (the k selected pairs, or a shard
        before it is shared): the bits are those of dividing the whole sum."""
        if self.settings.average and self.world.size > 1:
            values /= self.world.size
        return values

    def averaged_at(self, region: Any, positions: Any) -> None:
        """``averaged`` at ``positions`` of ``region``, which is zero elsewhere:
        indexed, or in one pass over the region when they are many (zero stays
        zero, so the bits are the same)."""
        if positions.size > WHOLE_PASS_BEYOND * region.size:
            self.averaged(region)
            passes.book("average", region.size, region.size)
        else:
            region[positions] = self.averaged(region[positions])

    # -- the public interface ----------------------------------------------------------
    @property
    def buffer(self) -> Any:
        """An array of the gradient's size and dtype to assemble the flat gradient
        in and pass to ``allreduce`` (``out=`` it too, to reduce in place). With
        ``shared_buffer=True``, ``hier_dense``, ``hitopk`` and ``adasum`` keep
        it in the node's shared memory and read it where it lies instead of
        copying it there (given several ranks on a node that shares memory,
        ``SPAR_COMM_SHM`` not 0, and a float32 or float64 gradient); other
        algorithms hand out plain memory.
        Passing another array instead overwrites all but this rank's shard of
        a shared buffer (that is where its parts are copied in)."""
        if self._buffer is None:
            self._buffer = self.xp.zeros(self.size, self.grad_dtype)
        return self._buffer

    def allreduce(self, grad: Any, out: Any = None, residual: Optional[Residual] = None,
                  density: Optional[float] = None, finite: Optional[bool] = None) -> Any:
        """The sum (or mean) of ``grad`` over all ranks, identical in every bit on every rank.

        Args:
            grad: a flat array where the topology put the rank: NumPy, or on a
                GPU CuPy or any CUDA array exporting DLPack (a torch tensor).
            out: the array to write the result into; ``out=grad`` reduces in
                place and saves an allocation.
            residual: this rank's residual held by the caller (a ``Residual``
                of ``residual_state()``'s span), updated in place of the one
                the allreducer holds (the JAX transformation threads it).
            density: this call's, in place of the allreducer's, at most
                ``max_density``, alike on every rank: a schedule changes it as
                optax's ``inject_hyperparams`` changes a learning rate.
            finite: whether ``grad`` holds no NaN or Inf, where the caller found
                out in a pass it made anyway (the torch optimizer's copy into
                a bucket); the call then makes no check pass. None: it checks.

        Returns:
            ``out``, or a new array of ``grad``'s kind. A float16 or bfloat16
            gradient is reduced in float32 and rounded once at the end (that
            rounding is not fed back: conservation holds for the float32 result).

        Raises:
            GradientError: on every rank, where any rank's gradient is refused
                (NonFiniteGradientError for NaN or Inf).
            ConfigError: on every rank, for a residual or density that does not fit.
            In each case every residual stays as it was.

        Example:
            >>> mean = reducer.allreduce(grad, out=grad, density=0.01)
            >>> reducer.last["bytes_inter"]
        """
        if self._kernels in _COMPILED:
            return self._allreduce(grad, out, residual, density, finite)
        # Each rank compiles the kernels on its own clock: the others' waits are long for a reason.
        with waiting.watched(f"the first {self.name} allreduce, which compiles its kernels", self.topology.world,
                             patient=True):
            result = self._allreduce(grad, out, residual, density, finite)
        _COMPILED.add(self._kernels)
        return result

    def _allreduce(self, grad: Any, out: Any, residual: Optional[Residual], density: Optional[float],
                   finite: Optional[bool]) -> Any:
        """``allreduce`` itself."""
        self.last = self._fresh_ledger()
        start = self.memory.now()
        given_grad, given_out = grad, out
        grad, back = self.memory.adopt(given_grad)
        if given_out is not None:
            out = grad if given_out is given_grad else self.memory.adopt(given_out)[0]
        density = self.density if density is None else density
        self._check(grad, out, given_out is not None, residual, density, finite)
        density = float(density)
        self.last["t_check"] = self.memory.now() - start
        feedback = self.feedback if residual is None else self.feedback.on_residual(residual)
        try:
            if self._wide is None:
                result = self._reduce(grad, Call(out, feedback, density))
            else:
                if not self.widens_in_sweep:
                    self._wide[...] = grad
                    passes.book("widen", grad.size, grad.size)
                    grad = self._wide
                result = self._narrowed(self._reduce(grad, Call(self._wide, feedback, density)), out)
        except BaseException:
            # Inputs were checked on every rank, so this is a failure of this rank
            # alone (a bug, memory, an interrupt) while the others wait in a
            # collective: end the whole job rather than leave them hanging.
            abort_job(self.topology.world, f"{self.name} allreduce")
        if math.isinf(self.last["threshold"]):  # nothing was selected: a dense method
            self.last["threshold"] = 0.0
        self.last["t_total"] = self.memory.now() - start
        return given_out if given_out is not None else back(result)

    @property
    def widens_in_sweep(self) -> bool:
        """Whether ``_reduce`` takes a 16-bit gradient as it is and widens it where
        it reads it (error feedback's sweep), instead of from a widened copy."""
        return False

    @property
    def keeps_residual(self) -> bool:
        """Whether this rank keeps a residual: error feedback is on, and the rank
        compresses something (a selection, a lossy codec, a low-rank factor)."""
        return self.feedback.on

    def residual_full(self) -> Any:
        """This rank's residual in global coordinates (zeros elsewhere), in
        ``dtype`` (float32 for a 16-bit gradient)."""
        full = self.xp.zeros(self.size, dtype=self.dtype)
        lo, hi = self.feedback.state.span
        full[lo:hi] = self.feedback.residual
        return full

    def residual_state(self, copy: bool = True) -> Tuple[Tuple[int, int], np.ndarray]:
        """This rank's residual for a checkpoint: its range ``[lo, hi)`` of the
        global vector and a copy of its values; with ``copy=False``, on the
        host, the values themselves (what a writer reads at once: no second
        residual in memory while it saves)."""
        values = self.feedback.residual
        if copy or not self.memory.in_host_memory:
            values = self.memory.to_host(values)
        return self.feedback.state.span, values

    def shared_state(self) -> Optional[np.ndarray]:
        """State every rank holds alike beside the residual, for a checkpoint
        (``powersgd``: the warm start Q), or None."""
        return None

    def load_shared_state(self, values: np.ndarray) -> None:
        """Restore what ``shared_state`` returned (same settings)."""
        raise_if_any(self.topology.world, f"{self.name} keeps no shared state to load")

    def load_residual_state(self, span: Tuple[int, int], values: np.ndarray) -> None:
        """Restore what ``residual_state`` returned on the same rank and layout.
        Collective: a residual that does not fit on any rank raises ConfigError
        on every rank, and nothing is loaded."""
        problem, mine = None, self.feedback.state
        if tuple(span) != tuple(mine.span) or np.shape(values) != mine.values.shape:
            problem = (f"saved residual covers {tuple(span)} with {np.shape(values)} values; "
                       f"this rank's covers {mine.span} with {mine.values.shape}")
        raise_if_any(self.topology.world, problem)
        mine.values[...] = self.xp.asarray(values)

    def free(self) -> None:
        """Release the node's shared-memory windows, where the algorithm holds
        them. Collective over the node; optional, since MPI_Finalize releases
        them too. Later calls go through MPI's Reduce_scatter and Allgatherv;
        an array taken from ``buffer`` before must not be used after."""
        if self.reduce_scatter is not None:
            for used in (self.reduce_scatter, self.allgather):
                used.free()
            self.reduce_scatter = MessageReduceScatter(self.local, self.counts)
            self.allgather = MessageAllgather(self.local, self.counts, self.dtype)
            self._buffer = None

    # -- internals ---------------------------------------------------------------------
    def _reduce(self, grad: Any, call: Call) -> Any:
        raise NotImplementedError

    def _narrowed(self, wide: Any, out: Any) -> Any:
        """The float32 result rounded to the gradient's dtype, into ``out`` if given."""
        passes.book("narrow", wide.size, wide.size)
        if out is None:
            return wide.astype(self.grad_dtype)
        out[...] = wide
        return out

    def _fresh_ledger(self) -> Dict[str, float]:
        ledger = dict.fromkeys(("t_check", "t_select", "t_intra", "t_inter"), 0.0)
        ledger["threshold"] = math.inf  # the smallest selected magnitude, lowered by select()
        ledger.update(dict.fromkeys(("k", "bytes_intra", "bytes_inter", "bytes_staged"), 0))
        if hasattr(self, "last"):  # channels hold the ledger: refill it in place
            self.last.clear()
            self.last.update(ledger)
            return self.last
        return ledger

    def _check(self, grad: Any, out: Any, out_given: bool, residual: Optional[Residual], density: Any,
               finite: Optional[bool]) -> None:
        """Gather every rank's verdict on its (adopted) gradient, ``out``,
        ``residual`` and ``density``, with the density itself (the ranks must
        agree on it: their messages are sized by it); raise alike on all ranks."""
        self._code[0] = problems_of(grad, out, self.size, self.grad_dtype, self.memory, finite)
        if out_given and out is None:  # given, but not an array of this memory
            self._code[0] |= BAD_OUT
        if residual is not None and not self.feedback.fits(residual, self.memory):
            self._code[0] |= BAD_RESIDUAL
        if not density_fits(density, self.max_density):
            self._code[0] |= BAD_DENSITY
        self._code[1] = np.float64(density).view(np.int64) if not self._code[0] & BAD_DENSITY else 0
        try:
            waiting.collective(self.topology.world, "Allgather", self._code, self._codes)  # where ranks meet: sleep
        except BaseException:  # an interrupt (Ctrl-C) of this rank alone, the others in the collective
            abort_job(self.topology.world, f"{self.name} allreduce")
        problems, densities = self._codes[:, 0], self._codes[:, 1].view(np.float64)
        if problems.any():
            raise refusal(self.name, problems, self.memory.kind, self.grad_dtype, self.size, self.max_density)
        if (densities != densities[0]).any():
            raise ConfigError(f"{self.name} allreduce: the ranks asked for different densities, nothing was "
                              f"changed: {', '.join(f'rank {r}: {d:g}' for r, d in enumerate(densities.tolist()))}")
