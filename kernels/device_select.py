"""Exact top-k on a GPU, under the CPU's contract, without waiting for the host.

The contract is the one of ``selection.py``: ``min(k, n)`` unique ascending
positions of the largest magnitude keys (``magnitude.py``: |x| by its bit
pattern, every NaN one key above Inf), ties to the lowest positions. Every
method finds the k-th largest key and writes the same set, so all give the
CPU methods' bits for the same input. They differ in the floor their
gather starts from (``select_plan.py`` has the steps):

* ``exact``: none; a radix select over the whole array (a read a byte of key).
* ``mstopk``: the paper's bisection of the threshold between the mean and the
  largest magnitude, on the keys, 255 thresholds a pass (8 halving steps a
  pass: its N = 30 steps take 4 passes), the first over the array and the
  others over the keys it keeps. Keys rather than values: they are monotone
  in the magnitude and 31 halvings end on one key.
* ``threshold``: a strided sample's radix select, with a margin of four
  standard deviations.
* ``threshold_warm``: the last call's k-th magnitude times a margin, which
  adapts by the CPU method's rule (``threshold.adapted_margin``).

A call queues a fixed sequence of launches on the current stream and returns
the answer on the device without a single read back to the host; the k-th
magnitude a selector keeps (``threshold``) and the warm start's margin are
read from the device only when asked for. CuPy arrays run ``select.cu``;
NumPy arrays run its numba-cuda twins (``select_numba.py``), which is how CI
runs every step, under Numba's CUDA simulator.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np

from .magnitude import float_layout
from .mstopk import checked_steps
from .select_plan import FLOORS, NO_KEY, SLOT, KernelSet, Workspace
from .selection import check_input, is_cupy, namespace, register
from .threshold import checked_margin, key_to_value


def kernels_for(x: Any) -> KernelSet:
    """``select.cu`` through CuPy for a CuPy array, its numba-cuda twins for NumPy's."""
    layout = float_layout(x.dtype)
    if layout is None:
        raise TypeError(f"device top-k needs float16, float32 or float64, got {x.dtype}")
    if is_cupy(x):
        from . import select_cuda

        return select_cuda.kernels()
    from . import select_numba

    return select_numba.kernels(np.dtype(layout.bits).itemsize * 8)


def bits_of(x: Any) -> Any:
    """``x``'s bits as unsigned integers of its width (a view)."""
    return x.view(float_layout(x.dtype).bits)


def all_positions(x: Any) -> Any:
    """Every position of ``x``: what each method returns for k >= n."""
    return namespace(x).arange(x.size, dtype=np.int64)


class DeviceSelector:
    """A selection method that keeps its workspace on the device between calls
    (so it allocates once, and a CUDA graph of a call stays valid). Its
    ``threshold`` is the last k-th magnitude, a read from the device made only
    when asked for (traces)."""

    #: Whether the workspace keeps the bisection's candidates (``Workspace.bisect``).
    bisects = False

    def __init__(self) -> None:
        self.workspace: Optional[Workspace] = None
        self.calls = 0

    def _workspace(self, x: Any, k: int) -> Workspace:
        """This call's workspace: the last one, or a new one that keeps its warm start."""
        old = self.workspace
        if old is None or not old.fits(x.size, x.dtype, k) or old.xp is not namespace(x):
            self.workspace = Workspace(kernels_for(x), x.size, x.dtype, k, self.bisects)
            if old is not None and old.xp is namespace(x):
                self.workspace.keep_warm_start(old)
            else:
                self._started(self.workspace)
        return self.workspace

    def _started(self, workspace: Workspace) -> None:
        """A first workspace: nothing to carry over."""

    def _select(self, workspace: Workspace, bits: Any) -> Any:
        raise NotImplementedError

    def __call__(self, x: Any, k: int) -> Any:
        check_input(x, k)
        if k >= x.size:
            return all_positions(x)
        workspace = self._workspace(x, k)
        positions = self._select(workspace, bits_of(x))
        self.calls += 1
        return positions

    @property
    def kth_key(self) -> Optional[int]:
        """The last call's k-th largest key (None before a call)."""
        if self.workspace is None:
            return None
        key = int(self.workspace.state[SLOT["previous"]])  # a read from the device, only when asked
        return None if key == int(NO_KEY) else key

    @property
    def threshold(self) -> Optional[float]:
        return None if self.workspace is None else key_to_value(self.kth_key, self.workspace.dtype)


class DeviceExact(DeviceSelector):
    """A radix select over the whole array, no floor."""

    def _select(self, workspace: Workspace, bits: Any) -> Any:
        positions = workspace.exact(bits)
        workspace.settle(adapt=False)
        return positions


class DeviceMSTopK(DeviceSelector):
    """The paper's bisection of the threshold between the mean and the largest
    magnitude, on the keys, 255 thresholds a pass (N halving steps in all); then
    a gather at the floor it ends on and the exact pick."""

    bisects = True

    def __init__(self, N: int = 30) -> None:
        super().__init__()
        self.passes = math.ceil(checked_steps(N) / math.log2(FLOORS + 1))

    def _select(self, workspace: Workspace, bits: Any) -> Any:
        workspace.bisect(bits, self.passes)
        positions = workspace.pick(bits)
        workspace.settle(adapt=False)
        return positions


class DeviceThreshold(DeviceSelector):
    """Sampled floor, one candidate pass, exact pick."""

    def _select(self, workspace: Workspace, bits: Any) -> Any:
        workspace.sample_floor(bits)
        positions = workspace.from_floor(bits)
        workspace.settle(adapt=False)
        return positions


class DeviceThresholdWarm(DeviceThreshold):
    """Starts from the last call's k-th magnitude times ``margin``, adapted by
    the CPU method's rule; the first call is ``DeviceThreshold``'s."""

    def __init__(self, margin: float = 0.9) -> None:
        super().__init__()
        self.initial_margin = checked_margin(margin)

    def _started(self, workspace: Workspace) -> None:
        workspace.margin.fill(self.initial_margin)

    def _select(self, workspace: Workspace, bits: Any) -> Any:
        if self.calls == 0:
            return super()._select(workspace, bits)
        workspace.warm_floor()
        positions = workspace.from_floor(bits)
        workspace.settle(adapt=True)
        return positions

    @property
    def margin(self) -> float:
        """The margin the next call starts from (read from the device)."""
        return self.initial_margin if self.workspace is None else float(self.workspace.margin[0])


def exact(x: Any, k: int) -> Any:
    """``DeviceExact`` once."""
    return DeviceExact()(x, k)


def mstopk(x: Any, k: int, N: int = 30) -> Any:
    """``DeviceMSTopK`` once."""
    return DeviceMSTopK(N)(x, k)


#: Method name -> factory of a device selector, as the host methods are named.
METHODS = {
    "exact": DeviceExact,
    "mstopk": DeviceMSTopK,
    "threshold": DeviceThreshold,
    "threshold_warm": DeviceThresholdWarm,
}
for _name, _factory in METHODS.items():
    register(_name, _factory, exact=True, device=True)
