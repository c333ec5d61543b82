"""A device selection never waits for the host: the GPU path (``select_cuda``,
which CuPy runs and the simulator never reaches) run against a stand-in for
CuPy whose arrays refuse every read back to the host and whose streams refuse
to synchronise. Its RawModule runs each kernel's numba-cuda twin instead, so
the answers are checked too, and every launch is recorded: a call is a fixed
sequence of launches, the same whatever the data."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest

pytest.importorskip("spar_comm.kernels.device_select", reason="numba-cuda is not installed")
from numba import config  # noqa: E402

from spar_comm.kernels import device_select, select_cuda, select_numba  # noqa: E402
from spar_comm.kernels.selection import exact_topk  # noqa: E402

pytestmark = [pytest.mark.skipif(not config.ENABLE_CUDASIM, reason="runs the twins under Numba's CUDA simulator"),
              pytest.mark.usefixtures("fast_simulator")]


class HostRead(AssertionError):
    """What the stand-in raises where real CuPy would wait for the device."""


def _refuse(what):
    def refuse(*args, **kwargs):
        raise HostRead(f"a selection read the device back to the host ({what})")

    return refuse


class ndarray:
    """Device memory as the selection may touch it: shapes, views, fills and
    device-to-device copies, never a value on the host."""

    __module__ = "cupy"

    def __init__(self, data: np.ndarray):
        self._data = data

    dtype = property(lambda self: self._data.dtype)
    size = property(lambda self: self._data.size)
    shape = property(lambda self: self._data.shape)
    ndim = property(lambda self: self._data.ndim)

    def view(self, dtype):
        return ndarray(self._data.view(dtype))

    def fill(self, value):
        self._data.fill(value)

    def __getitem__(self, index):
        if not isinstance(index, slice):
            raise HostRead("a selection indexed one element (a read once it is used)")
        return ndarray(self._data[index])

    def __setitem__(self, index, value):
        self._data[index] = value._data if isinstance(value, ndarray) else value

    get = tolist = item = __int__ = __float__ = __bool__ = __index__ = __array__ = __len__ = _refuse("a value")


def _poisoned(size, dtype):
    """New memory full of a byte pattern, so that a value never written shows."""
    data = np.empty(size, dtype=dtype)
    data.view(np.uint8).fill(0xA5)
    return ndarray(data)


def _stand_in(launches):
    """A ``cupy`` module: arrays, one device, and a RawModule of the twins."""
    cupy = types.ModuleType("cupy")
    cupy.ndarray = ndarray
    cupy.empty = _poisoned
    cupy.zeros = lambda size, dtype: ndarray(np.zeros(size, dtype=dtype))
    cupy.arange = lambda size, dtype: ndarray(np.arange(size, dtype=dtype))
    cupy.asnumpy = _refuse("asnumpy")

    class RawModule:
        def __init__(self, code, options, name_expressions):
            self.names = set(name_expressions)

        def get_function(self, expression):
            assert expression in self.names, expression
            name, _, template = expression.partition("<")
            width = {"unsigned short": 16, "unsigned int": 32, "unsigned long long": 64}.get(template.split(",")[0].strip(">"), 32)

            def run(grid, block, args):
                launches.append(name)
                host = [a._data if isinstance(a, ndarray) else a for a in args]
                select_numba.kernels(width).launch(name, "", grid[0], block[0], *host)

            return run

    cupy.RawModule = RawModule
    cuda = types.SimpleNamespace(
        Device=lambda: types.SimpleNamespace(id=0, synchronize=_refuse("Device.synchronize")),
        runtime=types.SimpleNamespace(deviceSynchronize=_refuse("deviceSynchronize")),
        Stream=types.SimpleNamespace(synchronize=_refuse("Stream.synchronize")),
        get_current_stream=lambda: types.SimpleNamespace(synchronize=_refuse("Stream.synchronize")))
    cupy.cuda = cuda
    return cupy


@pytest.fixture
def stand_in(monkeypatch):
    """CuPy replaced, and select_cuda's block shapes made the twins' (few
    threads: each simulated thread is a Python thread)."""
    launches = []
    monkeypatch.setitem(sys.modules, "cupy", _stand_in(launches))
    monkeypatch.setattr(select_cuda, "THREADS", select_numba.THREADS)
    monkeypatch.setattr(select_cuda, "_blocks_to_fill", lambda device: select_numba.BLOCKS)
    monkeypatch.setattr(select_cuda.CudaKernels, "compact_threads", select_numba.COMPACT_THREADS)
    monkeypatch.setattr(select_cuda.CudaKernels, "words", select_numba.WORDS)
    for cached in (select_cuda._module, select_cuda._kernels_of):
        cached.cache_clear()
    yield launches
    for cached in (select_cuda._module, select_cuda._kernels_of):
        cached.cache_clear()


def _inputs(dtype):
    rng = np.random.default_rng(17)
    x = rng.standard_normal(700).astype(dtype)
    x[[3, 650]] = [np.nan, np.inf]
    x[400:500] = x[399]  # ties
    calm = x.copy()
    flat = np.zeros_like(x)  # every key tied at zero: the floors admit nothing, the radix select reads it all
    return [x, calm * dtype(0.5), flat, x]


@pytest.mark.slow
@pytest.mark.parametrize("method", sorted(device_select.METHODS))
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_a_selection_queues_launches_and_never_reads_back(stand_in, method, dtype):
    selector = device_select.METHODS[method]()
    sequences = []
    for x in _inputs(dtype):
        stand_in.clear()
        got = selector(ndarray(x), 40)
        assert isinstance(got, ndarray)
        assert got._data.tolist() == exact_topk(x, 40).tolist(), method
        sequences.append(tuple(stand_in))
    assert stand_in and len(set(sequences[1:])) == 1, "a call's launches depend on its data"
    if method == "threshold_warm":  # the first call starts cold, from a sample
        assert sequences[0] != sequences[1]


def test_the_stand_in_refuses_what_real_cupy_would_wait_for(stand_in):
    """The check above can fail: a read of a value, or a sync, is refused."""
    a = ndarray(np.arange(4, dtype=np.uint64))
    for read in (lambda: int(a[0:1]), lambda: a.get(), lambda: float(a[1:2]), lambda: a[0],
                 lambda: sys.modules["cupy"].cuda.get_current_stream().synchronize()):
        with pytest.raises(HostRead):
            read()
    selector = device_select.DeviceThresholdWarm()
    selector(ndarray(np.linspace(-1, 1, 300).astype(np.float32)), 5)
    with pytest.raises(HostRead):
        selector.threshold  # the k-th magnitude is a read, made only when asked for
